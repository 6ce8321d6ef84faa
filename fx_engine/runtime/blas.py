"""Load an optimized BLAS before MLX is imported (Linux CPU).

Why: the Linux MLX CPU wheel links a bundled reference BLAS (~2-4 GFLOP/s for an f32 GEMM).
Loading MKL or OpenBLAS with RTLD_GLOBAL *before* `import mlx.core` makes MLX's `cblas_*`
calls resolve to it. Results stay correct either way; only the summation order of a GEMM
changes (see `batch_invariant` in fx_engine.core.nn).

Order of preference: MKL from PyPI (`mkl`, a dependency on Linux x86_64), then the system
OpenBLAS. Measured (docs/benchmarks-archive.md): on an AVX-512 Xeon MKL picks AVX-512 kernels and
streams a batch-1 GEMV near memory bandwidth (decode 1.75x, prefill@512 1.7x over Debian's
OpenBLAS 0.3.21, which does not know that CPU and runs SSE3 kernels); on an AMD Zen 4,
where MKL runs AVX2 kernels and OpenBLAS's own SGEMM is faster alone (151 vs 120 GFLOP/s
at 512 rows), fx-engine's prefill is still faster with MKL (a 512-token chunk 0.97-0.98 s
vs 1.12-1.33 s, 128 tokens 0.24-0.25 s vs 0.33-0.38 s: prefill attention's many small
GEMMs, and OpenBLAS's threads competing with the native kernels' pool). So MKL first on
every CPU.

MKL's Conditional Numerical Reproducibility (MKL_CBWR=AUTO) is left off: no run-to-run
difference was observed without it (same shapes, fresh buffers), and it cost ~20% of
decode speed here. Set it yourself for bitwise reproducibility guarantees across processes.

This module must not import mlx. `fx_engine.runtime.setup()` calls `preload()` first.
Set FX_ENGINE_BLAS=reference to keep the bundled BLAS, or to a library path to choose one.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig

_ACTIVE: dict[str, str] = {"name": "reference (bundled with mlx)", "path": ""}

_CANDIDATES = (
    # Debian/Ubuntu `libopenblas0-pthread` (the measured one), then other common layouts.
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def _mkl_complete(rt: str) -> bool:
    """libmkl_rt loads its core and threading layers lazily, at the first BLAS call, and
    exits the process if they are missing: check they sit beside it before choosing it."""
    d = os.path.dirname(rt)
    has = lambda pat: bool(glob.glob(os.path.join(d, pat)))  # noqa: E731
    return has("libmkl_core.so*") and (has("libmkl_intel_thread.so*") or has("libmkl_sequential.so*"))


def _pypi_candidates() -> list[str]:
    """MKL from PyPI (`pip install mkl`) exports the standard cblas symbols; its wheel puts
    libmkl_rt in the environment's lib/ folder."""
    roots = {sysconfig.get_paths()["purelib"], os.path.join(sys.prefix, "lib")}
    found: list[str] = []
    for root in roots:
        found += sorted(glob.glob(os.path.join(root, "libmkl_rt.so*")))
        found += sorted(glob.glob(os.path.join(root, "..", "..", "libmkl_rt.so*")))
    return [p for p in found if _mkl_complete(p)]


def preload() -> dict[str, str]:
    """Load the best available BLAS globally; a no-op on macOS or once mlx is imported."""
    if sys.platform != "linux":
        _ACTIVE.update(name="Accelerate (macOS system BLAS)", path="")
        return dict(_ACTIVE)
    choice = os.environ.get("FX_ENGINE_BLAS", "auto")
    if choice == "reference":
        return dict(_ACTIVE)
    if "mlx.core" in sys.modules:
        # Too late to interpose; report honestly instead of pretending.
        _ACTIVE["name"] = "unknown (mlx was imported before fx_engine; BLAS not preloaded)"
        return dict(_ACTIVE)
    paths = [choice] if choice != "auto" else [*_pypi_candidates(), *_CANDIDATES]
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        name = "MKL" if "mkl" in os.path.basename(path) else "OpenBLAS"
        if name == "MKL":
            # MKL's OpenMP threads spin for 200 ms after each call by default, holding a
            # core that the native kernels' pool needs (between prefill attention's BLAS
            # calls): measured here as 10-17% of a prefill's CPU time spent in that spin.
            # Read at MKL's first parallel call, so setting it now (before any) works.
            os.environ.setdefault("KMP_BLOCKTIME", "1")
        _ACTIVE.update(name=name, path=os.path.realpath(path))
        break
    return dict(_ACTIVE)


def active() -> dict[str, str]:
    """Which BLAS serves MLX's CPU matmuls in this process."""
    return dict(_ACTIVE)
