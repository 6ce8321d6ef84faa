"""1 process vs N tensor- or pipeline-parallel ranks on this machine (issue 27's measurement).

    python tools/bench_parallel.py [--model PATH] [--ranks 2] [--split tp|pp] [--rounds 3] [--tokens 64] [--json out.json]

Each round runs tools/tp_run.py alone and as a ring group of --ranks processes over
127.0.0.1 (fx_engine.testing.distributed.launch_local), alternating which goes first; each
run decodes --tokens tokens (EOS suppressed) three times and reports the last run's decode
and prompt speed. Also measured: the ring's all_sum latency for a tiny and a hidden-sized
vector (what each of a decode step's collectives costs here). Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fx_engine  # noqa: E402

fx_engine.setup()

from fx_engine.testing.distributed import launch_local  # noqa: E402
from tools.bench import machine_info  # noqa: E402

RUN = [sys.executable, str(ROOT / "tools" / "tp_run.py")]
LATENCY = """
import time, mlx.core as mx
g = mx.distributed.init()
out = {}
for n in (4, %d):
    x = mx.ones((n,))
    for _ in range(20): mx.eval(mx.distributed.all_sum(x))
    t = time.perf_counter()
    for _ in range(200): mx.eval(mx.distributed.all_sum(x))
    out[n] = (time.perf_counter() - t) / 200 * 1e6
if g.rank() == 0: print(out)
"""


def one(args: list[str], n: int, split: str = "tp") -> dict:
    if n == 1:
        p = subprocess.run(RUN + args, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    ranks = launch_local(n, RUN + [f"--{split}", str(n), *args], timeout=900)
    assert all(r.returncode == 0 for r in ranks), ranks[0].stderr[-2000:]
    return json.loads(ranks[0].stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--split", default="tp", choices=("tp", "pp"), help="tensor or pipeline parallel")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model = fx_engine.load(a.model)
    hidden = model.config.hidden_size
    args = ["--tokens", str(a.tokens), "--ignore-eos", "--runs", "3"] + (["--model", a.model] if a.model else [])
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(LATENCY % hidden)
    lat = launch_local(a.ranks, [sys.executable, f.name], timeout=300)
    latency_us = lat[0].stdout.strip()
    print("all_sum latency (us) by vector length:", latency_us)
    res: dict = {"1": [], str(a.ranks): []}
    for r in range(a.rounds):
        order = (1, a.ranks) if r % 2 == 0 else (a.ranks, 1)
        for n in order:
            out = one(args, n, a.split)
            res[str(n)].append({"decode_tps": out["decode_tps"], "prompt_tps": out["prompt_tps"]})
            print(f"round {r} ranks={n}: decode {out['decode_tps']:.1f} tok/s, prompt {out['prompt_tps']:.1f} tok/s",
                  flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("decode_tps", "prompt_tps")} for k, v in res.items()}
    med["decode_ratio"] = med[str(a.ranks)]["decode_tps"] / med["1"]["decode_tps"]
    print(json.dumps(med))
    report = {"machine": machine_info(), "args": vars(a), "all_sum_latency_us": latency_us,
              "summary": med, "runs": res}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
