"""Constrained vs unconstrained decode throughput (issue 24's benchmark), in one run.

    python tools/bench_constrained.py [--model PATH] [--runs 3] [--tokens 96] [--json out.json]

N rows (N = 1 and 8) decode --tokens tokens each in one Engine batch, greedy, on the default
model: free rows (EOS suppressed by a logit bias, so every row runs the full length) and
rows constrained by a JSON schema that cannot end within that many tokens (an array of at
least 10,000 objects with a string, an integer and an enum field: every step's mask is real
work for the grammar, not a fixed string). Throughput = all rows' decoded tokens / the
batch's decode time (first token to last, from each request's usage). Both kinds are
measured in every round, alternating which goes first; medians over --runs rounds. The
per-step host time spent on masks is reported too (the engine's decode trace events:
`host_seconds` covers building the masks and dispatching the step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fx_engine  # noqa: E402

fx_engine.setup()

from tools.bench import machine_info  # noqa: E402

SCHEMA = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"type": "string", "enum": ["alpha", "beta", "gamma"]}},
    "required": ["name", "n", "kind"], "additionalProperties": False}}
PROMPT = [{"role": "user", "content": "List records of people as JSON."}]


def run_batch(model, n: int, tokens: int, constrained: bool) -> dict:
    engine = fx_engine.Engine(model, max_rows=max(n, 1))
    kw = {"json_schema": SCHEMA} if constrained else {
        "logit_bias": {e: -1e9 for e in model.eos_ids}}
    t0 = time.perf_counter()
    hs = [engine.submit(PROMPT, max_tokens=tokens, temperature=0.0, **kw) for _ in range(n)]
    engine.close()  # runs every step on this thread
    wall = time.perf_counter() - t0
    outs = [h.result() for h in hs]
    gen = sum(o.usage.completion_tokens for o in outs)
    seconds = max(o.usage.generation_seconds for o in outs)
    decodes = [e for e in engine.trace_events if e["kind"] == "decode"]
    return {"tokens": gen, "decode_seconds": seconds, "tok_s": (gen - n) / seconds,
            "wall_seconds": wall, "finish": sorted({o.finish_reason for o in outs}),
            "step_ms": 1e3 * statistics.median(e["seconds"] for e in decodes),
            "host_ms": 1e3 * statistics.median(e["host_seconds"] for e in decodes),
            "sample": outs[0].text[:60]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model = fx_engine.load(a.model) if a.model else fx_engine.load()
    rows = [int(x) for x in a.rows.split(",")]
    for n in rows:  # warm-up: compiles, the grammar tokenizer
        for c in (False, True):
            run_batch(model, n, 8, c)
    results: dict = {str(n): {"free": [], "json_schema": []} for n in rows}
    for r in range(a.runs):
        for n in rows:
            order = (False, True) if r % 2 == 0 else (True, False)
            for c in order:
                res = run_batch(model, n, a.tokens, c)
                results[str(n)]["json_schema" if c else "free"].append(res)
                print(f"round {r} N={n} {'json_schema' if c else 'free':11s} "
                      f"{res['tok_s']:7.1f} tok/s  step {res['step_ms']:.1f} ms "
                      f"(host {res['host_ms']:.2f} ms)  {res['finish']}", flush=True)
    summary = {}
    for n in rows:
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("tok_s", "step_ms", "host_ms")}
               for k, v in results[str(n)].items()}
        med["ratio"] = med["json_schema"]["tok_s"] / med["free"]["tok_s"]
        summary[str(n)] = med
        print(f"N={n}: free {med['free']['tok_s']:.1f} tok/s, json_schema "
              f"{med['json_schema']['tok_s']:.1f} tok/s, ratio {med['ratio']:.3f}")
    report = {"machine": machine_info(), "args": vars(a), "schema": SCHEMA,
              "summary": summary, "runs": results}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
