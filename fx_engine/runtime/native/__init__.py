"""Native CPU kernels as MLX primitives: built on first use, optional, checked.

`ensure()` (called by `fx_engine.load` on the CPU) builds or loads the extension once per
process; the models then use the kernels through `fx_engine.core.nn` when the params' static
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

from ...core import kernels
from ...core.kernels import *  # noqa: F401,F403  (the ops, for shell callers)
from ...core.kernels import FEW_GEMM_ROWS, QMM_BITS, _module  # noqa: F401

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"module": None, "error": None, "path": None, "tried": False}


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
            kernels.install(mod)
            _STATE.update(module=mod, path=str(path), error=None, fallback=build.fallback(path))
        except Exception as e:  # noqa: BLE001 - any failure means: run without native kernels
            _STATE.update(module=None, error=f"{type(e).__name__}: {e}")
            kernels.install(None, f"unavailable: {_STATE['error']}")
            if mode == "require":
                raise RuntimeError(f"fx-engine native kernels unavailable: {e}") from e
            if not quiet:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(f"fx-engine: native CPU kernels unavailable, using MLX ops ({first})",
                      file=sys.stderr, flush=True)
        return _STATE["module"]


def _threads() -> int:
    """FX_ENGINE_THREADS, else the CPUs this process may run on, shared with the other
    ranks of an mx.distributed group started on this host (their pools would otherwise
    oversubscribe the cores: measured 2 ranks on 2 cores, decode 21 vs 46 tok/s)."""
    from fx_engine.runtime.distributed import ranks_on_this_host

    default = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    default = max(1, default // ranks_on_this_host())
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
    """available, path, error (why unavailable), threads, and fallback: why the loaded build
    is a more portable one than this machine's first choice (its flags failed), else None."""
    mod = _STATE["module"]
    return {"available": mod is not None, "path": _STATE["path"], "error": _STATE["error"],
            "threads": mod.num_threads() if mod is not None else None,
            "fallback": _STATE.get("fallback") if mod is not None else None}
