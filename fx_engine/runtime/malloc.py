"""Keep freed memory in the process (glibc malloc tuning, Linux; applied by
`fx_engine.runtime.setup()`).

Why: MLX's CPU backend allocates every intermediate array with malloc. glibc serves
blocks above its mmap threshold (128 KiB, adjusted upwards only as blocks are freed) with
fresh mmap()s and returns the top of the heap to the OS, so each step's multi-megabyte
intermediates (attention scores, MLP activations, logits) page-fault on first touch, every
step. Measured here (docs/benchmarks-archive.md): an elementwise op over 2.4M floats took 41-49
ms instead of 12, and prefill@2048 ran 25% slower. Raising the mmap threshold to glibc's
maximum (32 MiB) and disabling heap trimming keeps those blocks mapped and reused.

Cost: the process keeps its peak heap (like any caching allocator). FX_ENGINE_MALLOC=default
leaves glibc's behaviour alone. A no-op on other C libraries and platforms.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest accepted value on 64-bit
_STATE = {"tuned": False}


def tune() -> bool:
    """Apply the tuning once; returns whether it is active."""
    if _STATE["tuned"]:
        return True
    if sys.platform != "linux" or os.environ.get("FX_ENGINE_MALLOC", "auto") == "default":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD)) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)) == 1
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _STATE["tuned"] = ok
    return ok


def active() -> bool:
    return _STATE["tuned"]
