"""Process-level set-up, run by the shell's entry points (never by importing the core).

`setup()` loads the optimized BLAS (must happen before `mlx.core` is imported: MLX binds its
`cblas_*` symbols when it loads, see blas.py) and tunes glibc malloc (malloc.py). It runs
once per process, from: the `fx-engine` command, the public API's first use
(`fx_engine.load`, `fx_engine.Engine`, ...), importing any shell package
(fx_engine.engine, .loading, .server, .testing, .tracing), and programs that call
`fx_engine.setup()` before importing mlx themselves. The native CPU kernels are built and loaded on
`fx_engine.load` (native/), which then measures the matmul plan (native/plan.py).
Environment: FX_ENGINE_BLAS, FX_ENGINE_MALLOC, FX_ENGINE_NATIVE, FX_ENGINE_NATIVE_ARCH,
FX_ENGINE_THREADS (each documented in its module).

This package must not import mlx at import time (blas.py must run first).
"""

from __future__ import annotations

import sys
import threading

from . import blas, malloc

_DONE: list[bool] = []
_LOCK = threading.Lock()


def setup() -> dict[str, str]:
    """Preload the BLAS and tune malloc, once; returns the active BLAS (`blas.active()`)."""
    with _LOCK:
        if _DONE:
            return blas.active()
        _DONE.append(True)
        active = blas.preload()
        malloc.tune()
    if active["name"].startswith("unknown"):  # said once, never silently slow
        print("fx-engine: mlx was imported before fx_engine.setup(), so MLX's CPU matmuls "
              "keep its bundled reference BLAS (slow); call fx_engine.setup() before "
              "importing mlx", file=sys.stderr, flush=True)
    return blas.active()


__all__ = ["setup"]
