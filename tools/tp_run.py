"""One tensor-parallel run, for tests and measurements: every rank loads the model sharded
(`fx_engine.load(..., tensor_parallel=N)`) and runs the same work; rank 0 prints one JSON
line. Run under `mlx.launch -n N --backend ring python tools/tp_run.py ...` (or with N = 1
alone: the single-process reference).

    --model PATH   (default: the default model)   --tokens 16   --prompt TEXT
    --logits       also report the prompt's last-position logits (teacher-forced)
    --engine N     also run N concurrent requests through one Engine (continuous batching)
    --die-after S  (tests) rank 1 exits abruptly S seconds after loading
    --ignore-eos   decode all --tokens;  --runs R  repeat the generation (timings)
    --adapter DIR  generate with a LoRA adapter (the engine's odd rows too)
    --draft SPEC   speculative decoding with a draft model (a path, or self:N for the
                   target's first N layers); with --lockstep N, also N requests through a
                   lockstep Engine (rank 0 submits, the others follow; the draft named by
                   its place in Engine(drafts=), as `fx-engine serve` runs)
    --keep-quantized  every quantized weight kept packed (the GPU's form: MLX's kernels)
    --image SEED   a multimodal --model: the prompts are chat messages with one random image
                   (from SEED, the same on every rank) before the text
    --prefix-dir D with --lockstep: the lockstep Engine with the prefix cache's disk tier in
                   D, run twice (the second Engine starts with an empty memory tier, so its
                   requests restore from disk: "cached" per request)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_engine  # noqa: E402

fx_engine.setup()

import mlx.core as mx  # noqa: E402

from fx_engine.core.tree import tree_leaves  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (with --tp: tp x pp ranks under MPI)")
    ap.add_argument("--pp-layers", default=None, help="each stage's layer count, e.g. 4,2 (with --pp)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--logits", action="store_true")
    ap.add_argument("--engine", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--die-after", type=float, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="decode all --tokens (EOS suppressed)")
    ap.add_argument("--adapter", default=None, help="a LoRA adapter folder: every generation uses it")
    ap.add_argument("--sample", action="store_true", help="temperature 0.8 without a seed (the default seed)")
    ap.add_argument("--all-ranks", action="store_true", help="every rank prints its JSON line")
    ap.add_argument("--draft", default=None, help="a draft model path, or self:N")
    ap.add_argument("--lockstep", type=int, default=0, help="requests through a lockstep Engine")
    ap.add_argument("--prefix-dir", default=None, help="--lockstep: the disk tier's folder (two passes)")
    ap.add_argument("--kv-budget-bytes", type=int, default=None, help="--lockstep: the engine's KV budget")
    ap.add_argument("--keep-quantized", action="store_true", help="keep every quantized weight packed")
    ap.add_argument("--image", type=int, default=None, help="chat messages with a random image from this seed")
    a = ap.parse_args()
    import resource

    t_load = time.perf_counter()
    model = fx_engine.load(a.model, tensor_parallel=a.tp if a.tp > 1 else None,
                           pipeline_parallel=a.pp if a.pp > 1 else None,
                           pipeline_layers=[int(n) for n in a.pp_layers.split(",")] if a.pp_layers else None,
                           keep_quantized=True if a.keep_quantized else None)
    t_load = time.perf_counter() - t_load
    # VmHWM: this program's own peak (ru_maxrss also counts the parent's peak before exec)
    peak_load = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                     if line.startswith("VmHWM:")) if Path("/proc/self/status").exists() else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = mx.distributed.init().rank() if model.ranks > 1 else 0
    if a.die_after is not None and rank == 1:
        threading.Timer(a.die_after, lambda: os._exit(3)).start()
    out: dict = {"load_seconds": t_load, "peak_rss_after_load": peak_load,
                 "params_bytes": sum(x.nbytes for x in tree_leaves(model.params)),
                 "rank": rank, "size": model.ranks, "heads": model.config.num_heads,
                 "kv_heads": model.config.num_kv_heads, "layers": model.config.num_layers,
                 "fingerprint": model.fingerprint}
    kw = dict(max_tokens=a.tokens, temperature=0.0 if a.seed is None and not a.sample else 0.8, seed=a.seed)
    if a.ignore_eos:
        kw["logit_bias"] = {e: -1e9 for e in model.eos_ids}
    if a.adapter:
        kw["adapter"] = fx_engine.load_adapter(model, a.adapter, name="a")
    draft = None
    if a.draft:
        from fx_engine.engine.drafters import self_draft_model

        draft = (self_draft_model(model, int(a.draft[5:])) if a.draft.startswith("self:")
                 else fx_engine.load(a.draft))
        kw["draft_model"] = draft
    def prompt(text: str) -> object:
        return text if a.image is None else _image_messages(a.image, text)

    times = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        c = fx_engine.generate(model, prompt(a.prompt), **kw)
        times.append(time.perf_counter() - t0)
    out.update(tokens=list(c.token_ids), text=c.text, seconds=times,
               decode_tps=c.usage.generation_tps, prompt_tps=c.usage.prompt_tps)
    if a.logits:
        ids = model.tokenizer.encode(a.prompt)
        out["logits"] = fx_engine.logits(model, ids, adapter=kw.get("adapter"))[-1].tolist()
    if a.engine:
        # submitted before any step, then stepped on this thread: every rank runs the same
        # steps in the same order (its collectives must match the other ranks')
        engine = fx_engine.Engine(model, max_rows=a.engine, prefill_chunk=16)
        hs = [engine.submit(a.prompt + " x" * i, max_tokens=a.tokens, temperature=kw["temperature"],
                            adapter=kw.get("adapter") if i % 2 else None) for i in range(a.engine)]
        engine.close()
        out["engine"] = [list(h.result().token_ids) for h in hs]
    for _ in range(2 if a.lockstep and a.prefix_dir else 1 if a.lockstep else 0):
        sharded = model.ranks > 1
        engine = fx_engine.Engine(model, max_rows=a.lockstep, prefill_chunk=16, lockstep=sharded,
                                  drafts=[draft] if draft is not None and sharded else [],
                                  prefix_cache_dir=a.prefix_dir, kv_budget_bytes=a.kv_budget_bytes)
        out["kv_budget_tokens"], out["bytes_per_token"] = engine.kv_budget_tokens, engine.bytes_per_token
        if sharded and rank != 0:
            engine.follow()
        else:
            engine.start()
            hs = [engine.submit(prompt(a.prompt + " y" * i), **kw) for i in range(a.lockstep)]
            res = [h.result() for h in hs]
            engine.close()
            out["lockstep"] = [list(r.token_ids) for r in res]
            out["drafted"] = sum(r.usage.drafted_tokens for r in res)
            out.setdefault("cached", []).append([r.usage.cached_tokens for r in res])
    if rank == 0 or a.all_ranks:
        print(json.dumps(out), flush=True)


def _image_messages(seed: int, text: str) -> list[dict]:
    """One user turn: a random 48 x 40 RGB image (PNG bytes from `seed`), then `text`."""
    import io

    import numpy as np
    import PIL.Image

    buf = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buf, "PNG")
    return [{"role": "user", "content": [{"type": "image", "image": buf.getvalue()}, {"type": "text", "text": text}]}]


if __name__ == "__main__":
    main()
    from fx_engine.runtime.distributed import finish

    finish(0)  # (MPI subgroups: finalizes MPI and ends here)
