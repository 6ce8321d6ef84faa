#!/usr/bin/env python
"""Microbenchmark of fx-engine's native matmul kernels on the default model's shapes.

For each linear of one layer (qkv, o, gate_up, down) and the tied 8-bit head, and for each
row count M: the time of one product through `native.qmm` (float32, dequantized copy + inner
products), `native.qgemm` (float32: register tiles, and a few-row path up to 16 rows) and
`native.qmm_a8` (8-bit activations, int8 dot products; a few-row path up to 8 rows on
AVX-512 VNNI builds, vpmaddubsw on AVX2 builds), the median of --rounds rounds of
enough calls to take ~--budget seconds each, and GFLOP/s (2 * M * N * K / time). Which float
kernel fx_engine.core.nn runs is measured at load (`Numerics.matmul`, fx_engine.runtime.native.plan;
`fx-engine info` shows it); `Numerics.activation_bits=8` runs qmm_a8. This shows the three
side by side.

  python tools/bench_kernels.py --json docs/bench/kernels.json [--rows 1,8,32,512]

The machine is shared: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx

KERNELS = ("qmm", "qgemm", "qmm_a8")


def time_product(fn: Any, x: mx.array, lin: Any, rounds: int, budget: float) -> float:
    args = (x, lin.weight, lin.scales, lin.biases, lin.group_size, lin.bits)
    mx.eval(fn(*args))  # warm-up
    t0 = time.perf_counter()
    mx.eval(fn(*args))
    reps = max(1, int(budget / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([fn(*args) for _ in range(reps)])
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def run(rows: list[int], rounds: int, budget: float, log: Any = print) -> dict[str, Any]:
    from fx_engine.runtime import native

    model = fx_engine.load()
    if not model.params.numerics.native:
        raise SystemExit("the native kernels are not available on this machine")
    layer = model.params.layers[0]
    head = model.params.lm_head if model.params.lm_head is not None else model.params.embed
    lins = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down,
            "head": head}
    out: dict[str, Any] = {"int8_dot": native.int8_dot(), "isa": native.isa(),
                           "matmul_plan": str(model.params.numerics.matmul), "results": []}
    for m in rows:
        for name, lin in lins.items():
            n = lin.weight.shape[0]
            k = lin.weight.shape[1] * 32 // lin.bits
            x = mx.random.normal((m, k), key=mx.random.key(m))
            row: dict[str, Any] = {"rows": m, "linear": name, "n": n, "k": k, "bits": lin.bits}
            for kern in KERNELS:
                t = time_product(getattr(native, kern), x, lin, rounds, budget)
                row[kern] = {"us": t * 1e6, "gflops": 2 * m * n * k / t / 1e9}
            out["results"].append(row)
            log(f"M={m:4d} {name:8s} " + "  ".join(
                f"{kern} {row[kern]['us']:9.1f} us {row[kern]['gflops']:6.1f} GF/s" for kern in KERNELS))
    return out


def render(report: dict[str, Any]) -> str:
    lines = ["| M | linear | N x K (bits) | qmm us (GF/s) | qgemm us (GF/s) | qmm_a8 us (GF/s) | "
             "qgemm vs qmm | qmm_a8 vs the faster float kernel |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        picked = min(r["qgemm"], r["qmm"], key=lambda v: v["us"])
        cells = [f"{r[k]['us']:.0f} ({r[k]['gflops']:.0f})" for k in KERNELS]
        lines.append(f"| {r['rows']} | {r['linear']} | {r['n']} x {r['k']} ({r['bits']}) | "
                     + " | ".join(cells) + f" | {r['qmm']['us'] / r['qgemm']['us']:.2f}x"
                     + f" | {picked['us'] / r['qmm_a8']['us']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512", help="row counts M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per round")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    report = run([int(v) for v in a.rows.split(",") if v.strip()], a.rounds, a.budget)
    report["command"] = " ".join(["python", "tools/bench_kernels.py", *(argv if argv is not None else sys.argv[1:])])
    print(render(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
