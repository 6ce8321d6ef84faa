"""Prefix cache benchmark (`python tools/bench_prefix.py`, or `tools/bench.py --prefix`).

On the default model, in one run:
  ttft        time to first token of a request whose first 2,000 tokens are cached, against
              the same request cold (no prefix cache): a memory hit (the prefix was prefilled
              by an earlier request in the same engine), and a disk restore in a fresh
              process (an earlier process wrote the entry to a prefix-cache directory; the
              timed process loads the model, then times submit -> first token).
              Medians of --runs runs.
  chat        an 8-turn conversation (each turn: the whole history + a new user message,
              48 generated tokens, greedy) with and without the prefix cache: total time,
              prompt tokens, prompt tokens restored from the cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported

PREFIX_TOKENS = 2000


def shared_prefix(model: Any, n: int) -> list[int]:
    text = " ".join(f"Record {i}: the reading of sensor {i % 17} at station {i * 7 % 101} "
                    f"was {i * 13 % 97} units." for i in range(400))
    ids = model.tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def tail(model: Any, i: int) -> list[int]:
    return model.tokenizer.encode(f" Question {i}: which station reported {i * 3} units?")


def ttft(engine: Any, ids: list[int]) -> float:
    h = engine.submit(ids, max_tokens=1)
    h.result()
    return h.timings["first_token"] - h.timings["submitted"]


_CHILD = r"""
import sys, json, time
import fx_engine
model = fx_engine.load(sys.argv[1] or None)
ids = json.loads(sys.argv[3])
engine = fx_engine.Engine(model, max_rows=1, prefix_cache_dir=sys.argv[2])
h = engine.submit(ids, max_tokens=1)
out = h.result()
print(json.dumps({"ttft": h.timings["first_token"] - h.timings["submitted"],
                  "cached": out.usage.cached_tokens}))
"""


def disk_ttft(model_path: str, cache_dir: str, ids: list[int]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD, model_path, cache_dir, json.dumps(ids)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def chat(model: Any, prefix_bytes: int, turns: int = 8) -> dict[str, float]:
    engine = fx_engine.Engine(model, max_rows=1, prefix_cache_bytes=prefix_bytes)
    msgs = [{"role": "system", "content": "You are a concise assistant for a weather station."}]
    questions = ["What should I check first each morning?", "How often do I calibrate?",
                 "What if the wind sensor freezes?", "How do I log a storm?",
                 "Which readings matter most?", "How do I back up the data?",
                 "What do I do in a power cut?", "Summarise the routine."]
    t0 = time.perf_counter()
    prompt = cached = 0
    for q in questions[:turns]:
        msgs.append({"role": "user", "content": q})
        out = engine.submit(msgs, max_tokens=48, temperature=0.0).result()
        prompt += out.usage.prompt_tokens
        cached += out.usage.cached_tokens
        msgs.append({"role": "assistant", "content": out.text})
    return {"seconds": time.perf_counter() - t0, "prompt_tokens": prompt, "cached_tokens": cached}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model = fx_engine.load(a.model)
    prefix = shared_prefix(model, a.prefix_tokens)
    warm = fx_engine.Engine(model, max_rows=1, prefix_cache_bytes=0)
    ttft(warm, prefix + tail(model, 99))  # compiles every prefill bucket once
    cold, mem, disk, cached_mem, cached_disk = [], [], [], [], []
    for r in range(a.runs):
        cold.append(ttft(fx_engine.Engine(model, max_rows=1, prefix_cache_bytes=0),
                         prefix + tail(model, r)))
        e = fx_engine.Engine(model, max_rows=1)
        ttft(e, prefix + tail(model, 100 + r))  # fills the cache
        h = e.submit(prefix + tail(model, 200 + r), max_tokens=1)
        cached_mem.append(h.result().usage.cached_tokens)
        mem.append(h.timings["first_token"] - h.timings["submitted"])
        with tempfile.TemporaryDirectory() as d:
            fx_engine.Engine(model, max_rows=1, prefix_cache_dir=d).submit(
                prefix + tail(model, 300 + r), max_tokens=1).result()
            res = disk_ttft(a.model or "", d, prefix + tail(model, 400 + r))
            disk.append(res["ttft"])
            cached_disk.append(res["cached"])
        print(json.dumps({"run": r, "cold": cold[-1], "memory": mem[-1], "disk": disk[-1],
                          "cached_memory": cached_mem[-1], "cached_disk": cached_disk[-1]}), flush=True)
    med = {k: statistics.median(v) for k, v in (("cold", cold), ("memory", mem), ("disk", disk))}
    chats = {"off": chat(model, 0), "on": chat(model, 512 << 20)}
    report = {"model": model.path, "prefix_tokens": a.prefix_tokens, "runs": a.runs,
              "ttft_s": med, "memory_ratio": med["memory"] / med["cold"],
              "disk_ratio": med["disk"] / med["cold"], "cached_memory": cached_mem,
              "cached_disk": cached_disk, "chat": chats,
              "blas": __import__("fx_engine.runtime.blas", fromlist=["active"]).active()["name"]}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
