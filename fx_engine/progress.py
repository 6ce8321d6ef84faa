"""Progress for long work (the first-run native build, measuring the matmul plan, reading and
converting a large model, prefilling a cached prompt): a live spinner with the elapsed
seconds on a terminal (rich, on stderr), nothing in logs and pipes, where a line per event
is the caller's business.

    with working("compiling native CPU kernels, once per machine"):
        build()

FX_ENGINE_PROGRESS=1 forces it on (0: off); the default follows `sys.stderr.isatty()`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator

__all__ = ["interactive", "working"]

# a finished task leaves a line ("... done in 12.3 s") only when it was long enough to notice
LINGER_S = 3.0


def interactive() -> bool:
    """Whether progress is shown: FX_ENGINE_PROGRESS=1/0, else stderr is a terminal."""
    flag = os.environ.get("FX_ENGINE_PROGRESS", "").strip().lower()
    if flag in ("1", "on", "true", "yes"):
        return True
    if flag in ("0", "off", "false", "no"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


_ACTIVE: list[str] = []  # nested tasks show the outer spinner only (rich allows one live display)


@contextlib.contextmanager
def working(what: str) -> Iterator[None]:
    """A spinner "<what>... 4.2 s" while the block runs (terminal only); a closing line with
    the time when it ran for LINGER_S or more."""
    if not interactive() or _ACTIVE:
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    t0 = time.perf_counter()
    _ACTIVE.append(what)
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            bar.add_task(f"fx-engine: {what}...", total=None)
            yield
    finally:
        _ACTIVE.pop()
    took = time.perf_counter() - t0
    if took >= LINGER_S:
        console.print(f"[dim]fx-engine: {what}: done in {took:.1f} s[/dim]", highlight=False)
