#!/usr/bin/env python
"""Microbenchmark of fx-engine's native matmul kernels, on cold (streamed) or cached weights.

For each linear of one layer (qkv, o, gate_up, down) and the tied 8-bit head, and for each
row count M: the time of one product through `native.qmm` (float32, dequantized copy + inner
products), `native.qgemm` (float32: register tiles, and a few-row path up to 16 rows) and
`native.qmm_a8` (8-bit activations, int8 dot products; a few-row path up to 8 rows on
AVX-512 VNNI builds, vpmaddubsw on AVX2 builds), the median of --rounds rounds of
enough calls to take ~--budget seconds each, and GFLOP/s (2 * M * N * K / time). Which float
kernel fx_engine.core.nn runs is measured at load (`Numerics.matmul`, fx_engine.runtime.native.plan;
`fx-engine info` shows it); `Numerics.activation_bits=8` runs qmm_a8. This shows the three
side by side, with the weight bytes read per product over the time: GB/s.

Two modes (issue 41), labelled in the report's "mode":

  cold    (the default) every call multiplies a different copy of the linear's packed
          arrays, from a rotating set of at least --cold-mib MiB (default: the larger of
          256 MiB and 4x the L3): the weights stream from DRAM, as they do in a decode step
          of a model larger than the caches. The GB/s are printed next to the machine's
          DRAM read bandwidth, measured here first (tools/membw.py; --no-dram skips it).
  cached  (--cached) the same arrays on every call: matrices that fit in the L2/L3 stay
          there from call to call. This is how every figure before 2026-12-04 was taken
          (on the default model's matrices, at most ~1.3 MB): cache bandwidth, not DRAM's.

--model picks the matrices: a GGUF, or synth:SHAPE:QUANT (tools/synth_gguf.py, e.g.
synth:llama-1b:Q4_0: Llama 3.2 1B's shapes); default: the default model (the old figures).
--compare times every kernel both ways, cached and cold rounds alternating (this VM's memory
bandwidth drifts by a third from minute to minute, so separate runs do not compare well).

  python tools/bench_kernels.py --json docs/bench/kernels.json [--rows 1,8,32,512]
  python tools/bench_kernels.py --model synth:llama-1b:Q4_0 --rows 1,8 [--cached]

The machine is shared: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ modules
import membw  # noqa: E402

KERNELS = ("qmm", "qgemm", "qmm_a8", "qmm_a8_il")
#: the 8-bit mode runs its 4-/8-bit matrices in qmm_a8's interleaved layout (set at load:
#: fx_engine.core.nn.interleave_for_a8); "qmm_a8_il" times that layout, "qmm_a8" the rows
IL_KERNEL = "qmm_a8_il"


def _arrays(lin: Any) -> tuple[Any, ...]:
    return (lin.weight, lin.quant.scales, lin.quant.biases)


def weight_bytes(lin: Any) -> int:
    """The bytes one product reads from the weight: packed codes, scales, biases."""
    return sum(a.nbytes for a in _arrays(lin) if a is not None)


def _copy(a: Any) -> Any:
    if a is None:
        return None
    c = mx.array(np.array(a, copy=True))  # a buffer of its own
    mx.eval(c)
    return c


def weight_set(lin: Any, target_bytes: int) -> list[tuple[Any, ...]]:
    """The linear's arrays and enough distinct copies that the set holds >= target_bytes."""
    count = max(1, math.ceil(target_bytes / max(1, weight_bytes(lin))))
    return [_arrays(lin)] + [tuple(_copy(a) for a in _arrays(lin)) for _ in range(count - 1)]


def time_product(fn: Any, x: mx.array, lin: Any, rounds: int, budget: float,
                 weights: list[tuple[Any, ...]] | None = None) -> float:
    """The median over `rounds` of the mean time of one product. weights: a rotating set
    (cold mode: each call takes the next copy, round after round); None: lin's own arrays
    on every call (cached mode)."""
    weights = weights or [_arrays(lin)]
    cycle = itertools.cycle(weights)

    def call() -> Any:
        w, s, b = next(cycle)
        return fn(x, w, s, b, lin.quant.group_size, lin.quant.bits)

    mx.eval(call())  # warm-up
    t0 = time.perf_counter()
    mx.eval(call())
    reps = max(1, int(budget / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([call() for _ in range(reps)])
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def _model_path(spec: str | None) -> Any:
    if spec and spec.startswith("synth:"):
        import synth_gguf

        return synth_gguf.resolve(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    return spec


def run(rows: list[int], rounds: int, budget: float, log: Any = print, *, cold: bool = True,
        cold_bytes: int | None = None, model: str | None = None,
        dram: dict[str, Any] | None = None, layer_index: int = 0,
        compare: bool = False) -> dict[str, Any]:
    from fx_engine.runtime import native

    path = _model_path(model)
    loaded = fx_engine.load(path, numerics="exact")  # rows layout: every kernel reads it
    if not loaded.params.numerics.native:
        raise SystemExit("the native kernels are not available on this machine")
    layer = loaded.params.layers[layer_index]
    head = loaded.params.lm_head if loaded.params.lm_head is not None else loaded.params.embed
    lins = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down,
            "head": head}
    l3 = membw.l3_bytes()
    target = cold_bytes if cold_bytes is not None else max(256 * 2**20, 4 * l3)
    out: dict[str, Any] = {
        "int8_dot": native.int8_dot(), "isa": native.isa(),
        "matmul_plan": str(loaded.params.numerics.matmul), "model": str(path or "default model"),
        "layer": layer_index,
        "weight_format": loaded.weight_format, "threads": native.status().get("threads"),
        "mode": "compare" if compare else "cold" if cold else "cached", "l3_bytes": l3,
        "mode_note": (f"cold: each call reads a different copy of the weights, a rotating set of "
                      f">= {target / 2**20:.0f} MiB per linear (L3 {l3 / 2**20:.0f} MiB): DRAM "
                      "streaming" + ("; compare: each kernel's cached and cold rounds alternate, "
                                     "the cached figures under 'cached'" if compare else "")
                      if cold or compare else
                      "cached: the same weights on every call; what fits in L2/L3 stays there "
                      "(the figures before 2026-12-04)"),
        "dram": dram, "results": []}
    del loaded
    dram_gbs = dram["gbs"] if dram else None
    for name, lin in lins.items():
        n = lin.weight.shape[0]
        k = lin.weight.shape[1] * 32 // lin.quant.bits
        nbytes = weight_bytes(lin)
        weights = weight_set(lin, target) if cold or compare else None
        from fx_engine.core.nn import interleave_for_a8

        il = interleave_for_a8(lin)  # (unchanged where the 8-bit mode keeps rows: 5-/6-bit without il_planes)
        il_weights = (weight_set(il, target) if cold or compare else None) if il.interleaved else None
        for m in rows:
            x = mx.random.normal((m, k), key=mx.random.key(m))
            row: dict[str, Any] = {"rows": m, "linear": name, "n": n, "k": k, "bits": lin.quant.bits,
                                   "weight_bytes": nbytes,
                                   "copies": len(weights) if weights else 1}
            for kern in KERNELS:
                fn, kl, kw = getattr(native, kern, None), lin, weights
                if kern == IL_KERNEL:
                    if not il.interleaved:
                        row[kern] = {"error": "kept in rows by the 8-bit mode on this build: qmm_a8's figure"}
                        continue
                    fn, kl, kw = (lambda *a: native.qmm_a8(*a, interleaved=True)), il, il_weights
                try:
                    if compare:  # cached and cold rounds alternate: the same moment's machine
                        pairs = [(time_product(fn, x, kl, 1, budget, None),
                                  time_product(fn, x, kl, 1, budget, kw)) for _ in range(rounds)]
                        tc, t = (statistics.median(p[i] for p in pairs) for i in (0, 1))
                    else:
                        t = time_product(fn, x, kl, rounds, budget, kw)
                except (ValueError, RuntimeError) as e:  # e.g. qmm_a8 on 6-bit weights
                    row[kern] = {"error": str(e).splitlines()[0]}
                    continue
                row[kern] = {"us": t * 1e6, "gflops": 2 * m * n * k / t / 1e9,
                             "gbs": nbytes / t / 1e9}
                if compare:
                    row[kern]["cached"] = {"us": tc * 1e6, "gbs": nbytes / tc / 1e9}
                if dram_gbs:
                    row[kern]["of_dram"] = row[kern]["gbs"] / dram_gbs
            out["results"].append(row)
            log(f"M={m:4d} {name:8s} " + "  ".join(
                f"{kern} {row[kern]['us']:9.1f} us {row[kern]['gbs']:5.1f} GB/s" if "us" in row[kern]
                else f"{kern} n/a" for kern in KERNELS))
        del weights, il_weights
        mx.clear_cache()
    out["results"].sort(key=lambda r: (r["rows"], list(lins).index(r["linear"])))
    return out


def render(report: dict[str, Any]) -> str:
    d = report.get("dram")
    lines = [f"Mode: {report.get('mode', 'cached')} ({report.get('mode_note', '')}); model "
             f"{report.get('model', 'default model')} [{report.get('weight_format', '')}], layer "
             f"{report.get('layer', 0)}; "
             f"native ISA {report.get('isa')}, {report.get('threads')} threads. DRAM read "
             + (f"{d['gbs']:.1f} GB/s ({d['method']})." if d else "bandwidth not measured."), "",
             "| M | linear | N x K (bits), MB | qmm us (GF/s) GB/s | qgemm us (GF/s) GB/s | "
             "qmm_a8 us (GF/s) GB/s | qmm_a8 interleaved (the 8-bit mode's layout) | best GB/s / DRAM "
             "| qgemm vs qmm | qmm_a8 vs the faster float kernel |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        ok = {k: r[k] for k in KERNELS if k in r and "us" in r[k]}
        cells = [f"{r[k]['us']:.0f} ({r[k]['gflops']:.0f}) {r[k]['gbs']:.1f}"
                 + (f" [cached {r[k]['cached']['gbs']:.1f}]" if "cached" in r[k] else "") if k in ok else "n/a"
                 for k in KERNELS]
        best = max(v["gbs"] for v in ok.values())
        frac = f"{best / d['gbs']:.2f}" if d else "n/a"
        floats = [ok[k] for k in ("qgemm", "qmm") if k in ok]
        picked = min(floats, key=lambda v: v["us"])
        vs = f"{ok['qmm']['us'] / ok['qgemm']['us']:.2f}x" if len(floats) == 2 else "n/a"
        a8s = [ok[k] for k in ("qmm_a8", IL_KERNEL) if k in ok]
        a8 = f"{picked['us'] / min(v['us'] for v in a8s):.2f}x" if a8s else "n/a"
        lines.append(f"| {r['rows']} | {r['linear']} | {r['n']} x {r['k']} ({r['bits']}), "
                     f"{r['weight_bytes'] / 1e6:.1f} | " + " | ".join(cells) + f" | {frac} | {vs} | {a8} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,512", help="row counts M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.2, help="seconds per round")
    ap.add_argument("--model", default=None,
                    help="GGUF file or synth:SHAPE:QUANT (tools/synth_gguf.py); default: the default model")
    ap.add_argument("--layer", type=int, default=0,
                    help="the layer whose linears are timed (K-quant mixes differ per layer)")
    ap.add_argument("--cached", action="store_true",
                    help="the old mode: the same weights on every call (cache-resident when small)")
    ap.add_argument("--compare", action="store_true",
                    help="time each kernel cold and cached, rounds alternating (cold vs cache-resident)")
    ap.add_argument("--cold-mib", type=float, default=None,
                    help="cold mode: MiB of each linear's rotating set (default max(256, 4x L3))")
    ap.add_argument("--no-dram", action="store_true", help="skip the DRAM read bandwidth measurement")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dram = None
    if not a.no_dram:
        dram = membw.dram_read_gbs()
        print(f"DRAM read: {dram['gbs']:.1f} GB/s ({dram['method']})", file=sys.stderr, flush=True)
    report = run([int(v) for v in a.rows.split(",") if v.strip()], a.rounds, a.budget,
                 cold=not a.cached, model=a.model, dram=dram, layer_index=a.layer, compare=a.compare,
                 cold_bytes=None if a.cold_mib is None else int(a.cold_mib * 2**20))
    report["command"] = " ".join(["python", "tools/bench_kernels.py", *(argv if argv is not None else sys.argv[1:])])
    print(render(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
