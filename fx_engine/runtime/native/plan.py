"""Which native matmul path is fastest on this machine, measured (shell side).

The native build offers several ways to run a float32-activation product with 4-/8-bit
weights: `qgemm` (register tiles, plus a few-row path on AVX-512 and AVX2 builds), `qmm`
(inner products along k: weights dequantized in registers for a decode step's few rows,
a dequantized chunk under register tiles above) and a BLAS GEMM (MLX's dense matmul) on the
natively dequantized weight. Which is fastest depends on the CPU, the build's vector
width, the BLAS and the row count: on AVX-512 qgemm's tiles beat the GEMM at every row
count; on AVX2 the tile spills and the GEMM wins from a few dozen rows. So when a model
loads, `choose` times the candidates at the row counts a step uses on that model's most
common weight shape of each kernel layout (4-bit; bytes: 8-bit, 5-/6-bit unpacked),
weighed by the weights each stands for, and returns the `MatmulPlan` (static numerics:
part of the compile key) with a report of what was measured and why it chose so. The
kernels are timed as a step runs them: on weights streaming from memory (a rotating set of
copies larger than the caches), with float16 scales and biases (GGUF files' and MLX
checkpoints' storage, which the few-row paths dequantize with one FMA: Quant::fma_exact).
The kernel is the one with the smaller time over a request's calls (`REQUEST`): a step's
row count, not each product alike, is what a user waits on. Results are cached per build,
BLAS, thread count and shape, next to the native build (`plans.json`), so each shape is
measured once per machine; `fx-engine info` prints the report.

The plan is part of the numerics (in batch-invariant mode qgemm and qmm give different
bits; in the default mode the GEMM does): a first measurement taken on a busy machine is
what later loads reuse, and the 1.1x margin keeps a near-tie stable: there the kernel that
is clearly faster at one row (decode) is chosen, else qgemm stays. To pin it, pass
`fx_engine.load(..., matmul_plan=MatmulPlan(...))`, which skips the measurement.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from fx_engine.progress import working
from fx_engine.runtime.native import FEW_GEMM_ROWS, dequantize, qgemm, qmm, status, supports
from fx_engine.core.nn import MatmulPlan, linears

KERNEL_ROWS = (1, 8, 64, 512)  # qgemm vs qmm: decode, a decode batch, prefill chunks
# The calls of one request at those row counts: a 576-token prompt (a 512- and a 64-row
# chunk) and 256 generated tokens, half decoded alone and half in steps of 8 rows. Decode
# steps are most of a chat's time, so a kernel that is faster there (qmm's fused one-row
# path) wins though its prefill tiles are slower; a geometric mean over the row counts
# weighed a 512-row chunk like one decode step.
REQUEST = {1: 128, 8: 16, 64: 1, 512: 1}
COLD_BYTES = 96 << 20  # the rotating weights: more than an L3 (32 MB here) holds
GEMM_ROWS = (32, 64, 128, 256, 512)  # the BLAS GEMM competes above the few-row path
# (both kernels are timed at every row count of either tuple)
MARGIN = 1.1  # a path must be this much faster to replace the default qgemm (noise)
DECODE_ROWS = 1  # the row count that breaks a near-tie over a request: one decode step
PLAN_VERSION = 4  # bumped when what is measured changes: older entries are measured again


@attrs.frozen
class PlanReport:
    plan: MatmulPlan
    shape: str  # what was timed: "N x K, B-bit, group G" per kernel layout
    seconds: dict[str, dict[int, float]]  # candidate -> rows -> best seconds
    reason: str
    cached: bool = False

    def lines(self) -> list[str]:
        out = [f"plan for {self.shape}: kernel {self.plan.kernel}"
               + (f", BLAS GEMM on dequantized weights from {self.plan.gemm_from} rows (default mode)"
                  if self.plan.gemm_from else ", no BLAS GEMM"),
               f"  why: {self.reason}" + (" (cached measurement)" if self.cached else "")]
        for name, by_rows in self.seconds.items():
            cells = ", ".join(f"{m} rows {t * 1e6:.0f} us" for m, t in sorted(by_rows.items()))
            out.append(f"  {name:<6} {cells}")
        return out


def _time_all(fns: dict[str, Any], rounds: int = 5, budget: float = 0.15) -> dict[str, float]:
    """Seconds per call of each candidate: the best of `rounds` rounds, the candidates'
    rounds alternated (a burst of another process's load hits both, not one), after a
    warm-up. A round evaluates its calls as one graph, as a step does: a separate
    `mx.eval` per call adds ~35 us of MLX's own per-evaluation cost (measured on a 2-vCPU
    Zen 4), which in a one-row product of a small model's matrix (~70-100 us) diluted the
    kernels' ratio towards 1 (qgemm 1.25x qmm's time there, 1.4x evaluated as a graph)."""
    calls = {}
    for name, fn in fns.items():
        mx.eval(fn())
        t0 = time.perf_counter()
        mx.eval(fn())
        one = max(time.perf_counter() - t0, 1e-7)
        calls[name] = max(1, min(64, int(budget / len(fns) / rounds / one)))
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval([fn() for _ in range(calls[name])])
            best[name] = min(best[name], (time.perf_counter() - t0) / calls[name])
    return best


def measure(n: int, k: int, bits: int, gs: int) -> dict[str, dict[int, float]]:
    """Seconds per product of each candidate at each row count, on random weights of the
    given shape (the kernels' speed does not depend on the values), each call on the next
    of a rotating set of copies (COLD_BYTES in all: a decode step reads its weights from
    memory, and a one-row product that finds them in cache measures the cache)."""
    rng = np.random.default_rng(0)
    copies = max(1, min(64, -(-COLD_BYTES // (n * k * bits // 8))))
    # random packed integers, float16 scales and biases (mx.quantize has no group 16)
    mats = [(mx.array(rng.integers(0, 2**32, (n, k * bits // 32), dtype=np.uint32)),
             mx.array(rng.uniform(0.001, 0.01, (n, k // gs)).astype(np.float16)),
             mx.array(rng.uniform(-0.1, 0.1, (n, k // gs)).astype(np.float16))) for _ in range(copies)]
    mx.eval(mats)
    turn = [0]

    def args() -> tuple:
        turn[0] = (turn[0] + 1) % copies
        return (*mats[turn[0]], gs, bits)

    xs = {m: mx.array(rng.standard_normal((m, k)).astype(np.float32))
          for m in sorted(set(KERNEL_ROWS) | set(GEMM_ROWS))}
    mx.eval(list(xs.values()))
    out: dict[str, dict[int, float]] = {"qgemm": {}, "qmm": {}, "gemm": {}}
    for m, x in xs.items():
        fns = {"qgemm": lambda: qgemm(x, *args()), "qmm": lambda: qmm(x, *args())}
        if m in GEMM_ROWS:
            fns["gemm"] = lambda: x @ dequantize(*args()).T
        for name, t in _time_all(fns).items():
            out[name][m] = t
    return out


def request_seconds(by_rows: dict[int, float]) -> float:
    """One request's time in a kernel's products of the measured shape (REQUEST's calls)."""
    return sum(calls * by_rows[m] for m, calls in REQUEST.items())


def decide(seconds: dict[str, dict[int, float]]) -> tuple[MatmulPlan, str]:
    """The plan from measured times (pure; the property tests drive it with made-up ones).

    kernel: the one with MARGIN less time over a request's products (REQUEST; the kernel
    serves every row count: one summation order). In a near-tie (neither MARGIN faster over
    the request) the one MARGIN faster at a decode step's one row: a user waits on each
    generated token, and a near-tie means what it loses in prefill it gains back over the
    answer (measured, the default model's shapes on AMD Zen 4: qmm 1.4x faster at one row,
    1.2x slower at 512, the request 0.93-0.97x: float32 decode 64 -> 75 tok/s end to end,
    a 512-token prefill 720 -> 640 tok/s). Otherwise qgemm stays (a stable choice: the
    plan is part of the numerics). gemm_from: the smallest measured row count from which
    the GEMM (dequantizing included) is MARGIN faster than that kernel at it and at every
    larger measured count."""
    q, f = seconds["qgemm"], seconds["qmm"]
    ratio = request_seconds(f) / request_seconds(q)
    calls = ", ".join(f"{c} x {m}" for m, c in sorted(REQUEST.items()))
    if ratio * MARGIN < 1.0 or ratio > MARGIN:
        kernel = "qmm" if ratio * MARGIN < 1.0 else "qgemm"
        why = [f"{kernel} ({'qmm' if kernel == 'qgemm' else 'qgemm'} takes "
               f"{(ratio if kernel == 'qgemm' else 1 / ratio):.2f}x its time over a request's products: "
               f"{calls} rows)"]
    else:
        d = DECODE_ROWS
        kernel = "qmm" if f[d] * MARGIN < q[d] else "qgemm"
        why = [f"{kernel} (a near-tie over a request's products: {calls} rows, qmm {ratio:.2f}x "
               f"qgemm's time; at a decode step's {d} row qmm takes {f[d] / q[d]:.2f}x qgemm's time"
               f"{'' if kernel == 'qmm' else ', not ' + str(MARGIN) + 'x faster'})"]
    kern = f if kernel == "qmm" else q
    gemm_from = 0
    for m in sorted(GEMM_ROWS, reverse=True):
        if seconds["gemm"][m] * MARGIN < kern[m]:
            gemm_from = m
        else:
            break
    m = max(GEMM_ROWS)
    if gemm_from:
        why.append(f"the BLAS GEMM from {gemm_from} rows ({kern[m] / seconds['gemm'][m]:.2f}x "
                   f"{kernel}'s speed at {m} rows)")
    else:
        why.append(f"no BLAS GEMM (it runs at {kern[m] / seconds['gemm'][m]:.2f}x {kernel}'s "
                   f"speed at {m} rows; it must be {MARGIN}x faster to be chosen)")
    assert gemm_from == 0 or gemm_from > FEW_GEMM_ROWS
    return MatmulPlan(kernel=kernel, gemm_from=gemm_from), "; ".join(why)


MEASURED_ROWS = 16384  # a shape is timed on at most this many output features (a head's
# 128256 would take seconds a call at 512 rows); its time is scaled to its layout's weights


def _representatives(params: Any) -> list[tuple[tuple[int, int, int, int], int]]:
    """Per kernel layout (4-bit; bytes: 8-bit and 5-/6-bit unpacked), the native-kernel
    linears' shape (N, K, bits, group) holding the most weights, with that layout's total
    weights: largest first; empty if there are none. The layouts run different code (a
    Q4 file's Q6_K head is a quarter of its decode step), so each is timed."""
    totals: dict[tuple[int, int, int, int], int] = {}
    for lin in linears(params):
        q = lin.quant
        if lin.quantized and lin.weight.ndim == 2 and supports(q.group_size, q.bits):
            n, k = int(lin.weight.shape[0]), int(lin.weight.shape[1]) * 32 // q.bits
            totals[(n, k, q.bits, q.group_size)] = totals.get((n, k, q.bits, q.group_size), 0) + n * k
    out = []
    for layout in (4, 8):
        mine = {s: t for s, t in totals.items() if (s[2] == 4) == (layout == 4)}
        if mine:
            out.append((max(mine, key=lambda s: mine[s]), sum(mine.values())))
    return sorted(out, key=lambda r: -r[1])


def combine(parts: list[tuple[dict[str, dict[int, float]], float]]) -> dict[str, dict[int, float]]:
    """A step's products from the layouts' measurements: each (seconds, weights it stands
    for / weights measured) scaled and summed, per candidate and row count."""
    out: dict[str, dict[int, float]] = {}
    for seconds, scale in parts:
        for c, by_rows in seconds.items():
            for m, t in by_rows.items():
                out.setdefault(c, {})[m] = out.get(c, {}).get(m, 0.0) + scale * t
    return out


def _cache_file() -> Path | None:
    path = status().get("path")
    return Path(path).parent / "plans.json" if path else None


def _cache_key(shape: tuple[int, int, int, int]) -> str:
    from fx_engine.runtime.blas import active

    threads = {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                              "OPENBLAS_NUM_THREADS")}  # the GEMM's speed
    return json.dumps([PLAN_VERSION, status().get("threads"), sorted(active().items()),
                       sorted(threads.items()), list(shape)])


def _measured(shape: tuple[int, int, int, int], cache: dict[str, Any]) -> tuple[dict[str, dict[int, float]], bool]:
    """One shape's seconds: from the cache when complete, else measured (and put there)."""
    key = _cache_key(shape)
    try:
        seconds = {c: {int(m): float(t) for m, t in cache[key][c].items()} for c in ("qgemm", "qmm", "gemm")}
        decide(seconds)  # complete and usable, or measured again
        return seconds, True
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        n, k, bits, gs = shape
        with working(f"measuring the fastest matmul kernels for {n} x {k}, {bits}-bit, group {gs}, "
                     "once per machine"):
            seconds = measure(n, k, bits, gs)
        cache[key] = seconds
        return seconds, False


def choose(params: Any) -> PlanReport | None:
    """The measured plan for a model's params (None: no quantized linear to measure)."""
    reps = _representatives(params)
    if not reps:
        return None
    file = _cache_file()
    cache: dict[str, Any] = {}
    if file is not None and file.exists():
        try:
            cache = json.loads(file.read_text())
        except (OSError, ValueError):
            pass
        cache = cache if isinstance(cache, dict) else {}
    everything = sum(total for _, total in reps)
    parts, descs, cached = [], [], True
    for (n, k, bits, gs), total in reps:
        rows = min(n, MEASURED_ROWS)
        seconds, hit = _measured((rows, k, bits, gs), cache)
        cached = cached and hit
        parts.append((seconds, total / (rows * k)))
        descs.append(f"{rows} x {k}" + (f" (of {n})" if rows < n else "")
                     + f", {bits}-bit, group {gs}" + (f": {100 * total / everything:.0f}% of the weights" if len(reps) > 1 else ""))
    if not cached and file is not None:
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, file)
        except OSError:
            pass  # a read-only cache: measured again next time
    # one layout: its own times (per product); several: a step's products, scaled
    seconds = parts[0][0] if len(parts) == 1 else combine(parts)
    plan, reason = decide(seconds)
    return PlanReport(plan=plan, shape="; ".join(descs), seconds=seconds, reason=reason, cached=cached)
