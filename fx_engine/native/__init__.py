"""Native CPU kernels as MLX primitives: built on first use, optional, checked.

`ensure()` (called by `fx_engine.load` on the CPU) builds or loads the extension once per
process; the models then use the kernels through `fx_engine.nn` when the params' static
`Numerics.native` says so. If the extension cannot be built (no compiler, no nanobind, an
unsupported platform), everything runs on MLX's own ops, as before: same results up to
float32 rounding, slower on the CPU.

FX_ENGINE_NATIVE: "auto" (default: build if needed, fall back quietly with a one-line
warning), "0"/"off" (never), "require" (an error if unavailable), "rebuild" (rebuild now).
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"module": None, "error": None, "path": None, "tried": False}

QMM_BITS = (4, 8)


def _mode() -> str:
    return os.environ.get("FX_ENGINE_NATIVE", "auto").strip().lower()


def ensure(*, quiet: bool = False) -> ModuleType | None:
    """The loaded extension, building it if needed; None when unavailable (see `status`)."""
    mode = _mode()
    if mode in ("0", "off", "false", "no"):
        return None
    with _LOCK:
        if _STATE["tried"] and (mode != "rebuild" or _STATE.get("rebuilt")):
            if _STATE["module"] is None and mode == "require":
                raise RuntimeError(f"fx-engine native kernels unavailable: {_STATE['error']}")
            return _STATE["module"]
        _STATE["tried"] = True
        _STATE["rebuilt"] = mode == "rebuild"  # once per process (the .so stays loaded anyway)
        log = None if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        try:
            from . import build  # POSIX only (fcntl); elsewhere: MLX ops

            path = build.build(force=mode == "rebuild", log=log)
            mod = build.import_extension(path)
            mod.set_num_threads(_threads())
            _STATE.update(module=mod, path=str(path), error=None)
        except Exception as e:  # noqa: BLE001 - any failure means: run without native kernels
            _STATE.update(module=None, error=f"{type(e).__name__}: {e}")
            if mode == "require":
                raise RuntimeError(f"fx-engine native kernels unavailable: {e}") from e
            if not quiet:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(f"fx-engine: native CPU kernels unavailable, using MLX ops ({first})",
                      file=sys.stderr, flush=True)
        return _STATE["module"]


def _threads() -> int:
    """FX_ENGINE_THREADS, else the CPUs this process may run on."""
    default = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    raw = os.environ.get("FX_ENGINE_THREADS", "").strip()
    if not raw:
        return max(1, default)
    try:
        return max(1, int(raw))
    except ValueError:
        print(f"fx-engine: FX_ENGINE_THREADS={raw!r} is not an integer; using {default} threads",
              file=sys.stderr, flush=True)
        return max(1, default)


def available() -> bool:
    return _STATE["module"] is not None


def status() -> dict[str, Any]:
    mod = _STATE["module"]
    return {"available": mod is not None, "path": _STATE["path"], "error": _STATE["error"],
            "threads": mod.num_threads() if mod is not None else None}


def _module() -> ModuleType:
    # The ops never build or load anything themselves (the pure core calls them): the
    # shell's fx_engine.load, or the caller, runs ensure() first.
    mod = _STATE["module"]
    if mod is None:
        why = _STATE["error"] or "fx_engine.native.ensure() has not been called in this process"
        raise RuntimeError("these params use fx-engine's native kernels, which are not loaded "
                           f"({why}); call fx_engine.native.ensure() first, or load with native=False")
    return mod


def qmm(x, w, scales, biases, group_size: int, bits: int):  # type: ignore[no-untyped-def]
    """x[..., K] @ dequantize(w, scales, biases).T -> [..., N]: a pure op (an MLX primitive)."""
    return _module().qmm(x, w, scales, biases, group_size, bits)


def qgemm(x, w, scales, biases, group_size: int, bits: int):  # type: ignore[no-untyped-def]
    """qmm's product with the many-rows kernel: vectors along the rows of x, register tiles
    of 12 features x 32 rows. ~2x qmm's speed from ~16 rows up; below that most vector
    lanes are padding. Batch-invariant too, with another fixed summation order than qmm
    (each output a sequential float32 sum over K), so the two differ in the last bits."""
    return _module().qgemm(x, w, scales, biases, group_size, bits)


def qmm_a8(x, w, scales, biases, group_size: int, bits: int):  # type: ignore[no-untyped-def]
    """The product with 8-bit activations (`Numerics.activation_bits == 8`): each row of x
    rounded per weight group (d = amax / 127, xq = rint(x / d)), y = x_hat @ w_hat.T with
    exact int32 dot products per group, combined in float32 in group order. A different
    (coarser) numerics than qmm/qgemm, like llama.cpp's 8-bit activations; batch-invariant
    and tile-independent bit for bit (the integer sums are exact)."""
    return _module().qmm_a8(x, w, scales, biases, group_size, bits)


def int8_dot() -> bool:
    """Whether qmm_a8 runs the CPU's int8 dot products (AVX-512 VNNI, AVX-VNNI or AVX2's
    vpmaddubsw); without them it runs a scalar loop: the same values, much slower."""
    return bool(getattr(_module(), "int8_dot", False))


def int8_dot_isa() -> str:
    """Which instructions qmm_a8's exact integer sums run on this build."""
    return str(getattr(_module(), "int8_dot_isa", "unknown"))


def tiled_gemm() -> bool:
    """Whether qgemm's register tile fits this build's vector registers (AVX-512); AVX2
    builds run qgemm's few-row path at every row count instead (fx-engine info)."""
    return bool(getattr(_module(), "tiled_gemm", False))


FEW_GEMM_ROWS = 16  # qgemm's few-row path takes up to this many rows (kernels.cpp QG_FEW)


def few_gemm() -> bool:
    """Whether qgemm has its few-row path (vectors along the features, weights dequantized
    in registers: AVX-512 and AVX2 builds), the fast kernel for decode batches."""
    return bool(getattr(_module(), "few_gemm", False))


def isa() -> str:
    """The vector instruction set this build's kernels were written for: avx512, avx2,
    neon or generic."""
    return str(getattr(_module(), "isa", "generic"))


def dequantize(w, scales, biases, group_size: int, bits: int):  # type: ignore[no-untyped-def]
    """Affine dequantization to float32 [N, K] (multi-threaded; the same values as
    mx.dequantize), from the unpacking qmm and qgemm use (the tests check it bit for bit).
    fx_engine.nn runs a BLAS GEMM on it for many-row products where qgemm's tile does not
    fit the build (no AVX-512)."""
    return _module().dequantize(w, scales, biases, group_size, bits)


def supports(group_size: int, bits: int) -> bool:
    return bits in QMM_BITS and group_size > 0 and group_size % 32 == 0


def masked_softmax(scores, mask):  # type: ignore[no-untyped-def]
    """Softmax over the last axis of float32 scores [B, H, T, S], taking only the slots where
    bool mask [B, T, S] is set (softmax(where(mask, scores, finfo.min)), one pass, `fast_exp`'s
    polynomial)."""
    return _module().masked_softmax(scores, mask)


def rms_norm(x, weight, eps: float):  # type: ignore[no-untyped-def]
    """x * rsqrt(mean(x**2, -1) + eps) * weight, in float32, in one node."""
    return _module().rms_norm(x, weight, eps)


def kv_put(cache, new, slots):  # type: ignore[no-untyped-def]
    """cache [B, H, S, D] (float32/float16) with new [B, H, T, D] written at slots [B, T]:
    mx.put_along_axis(cache, slots[:, None, :, None], new, axis=2) in one node, in place
    when the cache's buffer is donatable. Slots outside [0, S) are skipped."""
    return _module().kv_put(cache, new, slots)


def swiglu(gu):  # type: ignore[no-untyped-def]
    """silu(gate) * up for the fused gate|up projection gu [..., 2F] -> [..., F], in one
    node, with fx_engine.nn.fast_exp's arithmetic (float32)."""
    return _module().swiglu(gu)


def attend(q, k, v, mask, scale: float):  # type: ignore[no-untyped-def]
    """Grouped-query attention in one node for a few query tokens per row (decode, verify):
    q [B, T, Hq, D] (float32), k/v [B, Hk, S, D] (strided views of the cache are read in
    place), bool mask [B, T, S] -> [B, T, Hq * D]."""
    return _module().attend(q, k, v, mask, scale)


def rope(x, cos, sin, traditional: bool):  # type: ignore[no-untyped-def]
    """RoPE with precomputed tables (fx_engine.nn.rope_tables): x [B, T, H, D] float32,
    cos / signed sin [B, T, 1, D]."""
    return _module().rope(x, cos, sin, traditional)
