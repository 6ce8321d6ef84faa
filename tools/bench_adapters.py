"""Decode throughput with per-row LoRA adapters vs the base model (issue 26's benchmark).

    python tools/bench_adapters.py [--model PATH] [--runs 3] [--tokens 96] [--rank 8] [--json out.json]

N = 8 rows decode --tokens tokens each in one Engine batch (greedy, EOS suppressed by a logit
bias so every row runs the full length) on the default model: all rows on the base model,
vs the 8 rows spread over 4 different adapters (2 rows each). The adapters are made by
mlx-lm's own `linear_to_lora_layers` (tools/oracle.write_mlx_lm_adapter, random factors) on
every projection (q, k, v, o, gate, up, down) of every layer (or the last --num-layers) at
--rank: the heaviest common configuration. Throughput = all rows' decoded tokens / the batch's decode time; both kinds
in every round, alternating which goes first; medians over --runs rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fx_engine  # noqa: E402

fx_engine.setup()

from tools.bench import machine_info  # noqa: E402
from tools.oracle import write_hf_folder, write_mlx_lm_adapter  # noqa: E402

KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def run_batch(model, adapters: list, tokens: int) -> dict:
    engine = fx_engine.Engine(model, max_rows=len(adapters))
    bias = {e: -1e9 for e in model.eos_ids}
    t0 = time.perf_counter()
    hs = [engine.submit(PROMPT, max_tokens=tokens, temperature=0.0, logit_bias=bias, adapter=a)
          for a in adapters]
    engine.close()  # runs every step on this thread
    wall = time.perf_counter() - t0
    outs = [h.result() for h in hs]
    n = len(adapters)
    gen = sum(o.usage.completion_tokens for o in outs)
    seconds = max(o.usage.generation_seconds for o in outs)
    decodes = [e for e in engine.trace_events if e["kind"] == "decode"]
    return {"tokens": gen, "decode_seconds": seconds, "tok_s": (gen - n) / seconds, "wall_seconds": wall,
            "step_ms": 1e3 * statistics.median(e["seconds"] for e in decodes),
            "distinct_outputs": len({o.text for o in outs})}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=-1, help="adapt the last N layers (-1: all; mlx-lm's default is 16)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model = fx_engine.load(a.model) if a.model else fx_engine.load()
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_hf_folder(model, Path(tmp) / "hf")  # mlx-lm builds the LoRA layers on this
        for i in range(4):
            ad = write_mlx_lm_adapter(hf, Path(tmp) / f"a{i}", rank=a.rank, keys=KEYS, seed=i, init_scale=0.02,
                                      num_layers=a.num_layers)
            fx_engine.load_adapter(model, ad, name=f"a{i}")
    kinds = {"base": [None] * 8, "4_adapters": [f"a{i % 4}" for i in range(8)]}
    for rows in kinds.values():  # warm-up: compiles
        run_batch(model, rows, 8)
    results: dict = {k: [] for k in kinds}
    for r in range(a.runs):
        order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
        for k in order:
            res = run_batch(model, kinds[k], a.tokens)
            results[k].append(res)
            print(f"round {r} {k:10s} {res['tok_s']:7.1f} tok/s  step {res['step_ms']:.1f} ms  "
                  f"distinct outputs {res['distinct_outputs']}", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "step_ms")} for k, v in results.items()}
    med["ratio"] = med["4_adapters"]["tok_s"] / med["base"]["tok_s"]
    print(f"N=8: base {med['base']['tok_s']:.1f} tok/s, 4 adapters {med['4_adapters']['tok_s']:.1f} tok/s, "
          f"ratio {med['ratio']:.3f}")
    report = {"machine": machine_info(), "args": vars(a), "summary": med, "runs": results}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
