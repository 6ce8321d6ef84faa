"""Multi-process runs on `mx.distributed` (tensor and pipeline parallelism): the world
group (or its tensor x pipeline mesh of subgroups), and a watchdog that turns a lost rank
into an error instead of a hang.

Why a watchdog: when a rank dies, MLX's ring backend logs "Too many send/recv errors.
Failing pending tasks..." on the others, but the evaluation waiting on the collective
never returns (measured: mlx 0.32.4, rank 0 blocked until killed). `mlx.launch` kills the
survivors itself (and still exits 0); processes started any other way would wait forever.
So every engine step of a sharded model (tensor or pipeline parallel) runs inside `busy()`, and a step that has
not finished after FX_ENGINE_TP_TIMEOUT seconds (default 120; a step takes well under a
second on a healthy group) ends the process with exit code 70 and a message saying which
rank gave up and why. When the ring does notice (a step waiting on a socket the dead rank
closed raises "[ring] connection to a peer was lost"), the step ends the same way: a lost
rank is exit code 70 on every survivor, whichever way it shows.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from typing import Any, Iterator, NamedTuple

EXIT_CODE = 70  # EX_SOFTWARE

_lock = threading.Lock()
_busy_since: list[float] = []
_watchdog: list[threading.Thread] = []
_rank: list[int] = []


def _exit_lost(rank: int, why: str) -> None:
    sys.stderr.write(f"fx-engine: rank {rank}: {why}: another rank has failed or stopped "
                     "answering; exiting\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def peer_lost(e: BaseException) -> bool:
    """Whether an exception is MLX's ring backend reporting a rank gone."""
    text = str(e)
    return "[ring]" in text and ("lost" in text or "closed" in text)


class Mesh(NamedTuple):
    """This process's place in a tensor x pipeline run: `pipeline` stages of `tensor` ranks
    each, world rank r at stage r // tensor, tensor rank r % tensor (a stage's ranks are
    neighbours: on several hosts, put them on one host, where the all_sums are). The groups
    are None where one kind alone uses the world group."""
    tensor_rank: int
    stage: int
    tensor_group: Any  # the ranks of this stage (subgroup), or None
    pipeline_group: Any  # this tensor rank of every stage (subgroup), or None


_split_groups: list[bool] = []


def mesh(tensor: int, pipeline: int) -> Mesh:
    """The world group laid out as `pipeline` stages of `tensor` ranks (checked to have
    tensor x pipeline processes; starts the watchdog). Both > 1 needs subgroups
    (`group.split`): MLX's MPI backend has them, its ring backend does not (ValueError)."""
    import mlx.core as mx

    size = tensor * pipeline
    if pipeline == 1 or tensor == 1:
        group = world(size, "tensor" if pipeline == 1 else "pipeline")
        r = group.rank()
        return Mesh(r % tensor, r // tensor, None, None)
    group = mx.distributed.init()
    if group.size() != size:
        raise ValueError(f"tensor_parallel={tensor} x pipeline_parallel={pipeline} needs {size} processes "
                         f"in mx.distributed's group (start them with `mpirun -np {size} ...`); this one "
                         f"sees {group.size()}")
    r = group.rank()
    stage, t = r // tensor, r % tensor
    try:  # (collective: every rank makes both splits, in this order)
        tensor_group = group.split(stage, t)
        pipeline_group = group.split(t, stage)
    except RuntimeError as e:
        raise ValueError(f"tensor_parallel with pipeline_parallel needs mx.distributed subgroups, which "
                         f"this backend does not have ({e}); MLX's MPI backend does: launch with "
                         f"`mpirun -np {size} ...` or `mlx.launch --backend mpi -n {size} ...`") from None
    _start(r)
    with _lock:
        if not _split_groups:
            _split_groups.append(True)
            atexit.register(_finish_at_exit)
            sys.excepthook = _note_failure(sys.excepthook)
    return Mesh(t, stage, tensor_group, pipeline_group)


_exit_state = {"failed": False, "in_handlers": False}


def _finish_at_exit() -> None:
    import logging

    _exit_state["in_handlers"] = True
    logging.shutdown()  # (registered before this handler, so it would not run after it)
    finish(1 if _exit_state["failed"] else 0)


def _note_failure(hook: Any) -> Any:
    def seen(*args: Any) -> Any:
        _exit_state["failed"] = True
        return hook(*args)

    return seen


def finish(code: int = 0) -> int:
    """End this process with `code` where MPI subgroups are alive (`mesh`): MLX frees them
    after MPI has finalized at exit, which Open MPI aborts on ("MPI_Comm_free() called after
    MPI_FINALIZE"; mlx 0.32.4); so MPI is finalized here, then the process ends at once.
    Elsewhere a no-op returning `code`. Programs running a tensor x pipeline model end with
    `sys.exit(finish(code))` (the command line does; without it an exit handler does the
    same, with status 1 after an uncaught exception, else 0)."""
    if not _split_groups:
        return code
    import ctypes

    if not _exit_state["in_handlers"]:  # called by the program: the exit handlers first
        atexit.unregister(_finish_at_exit)
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    lib = _libmpi()
    if lib is not None:
        mpi = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        done = ctypes.c_int(0)
        mpi.MPI_Finalized(ctypes.byref(done))  # (an exit handler may have finalized it)
        if not done.value:
            mpi.MPI_Finalize()
    os._exit(code)


def _libmpi() -> str | None:
    """The path of the MPI library MLX loaded into this process (None: not found)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libmpi.so" in line}
    except OSError:
        return None
    return min(paths) if paths else None


def world(size: int, kind: str = "tensor") -> Any:
    """mx.distributed's world group, checked to have `size` processes; starts the watchdog."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() != size:
        raise ValueError(f"{kind}_parallel={size} needs {size} processes in mx.distributed's group "
                         f"(start them with `mlx.launch -n {size} --backend ring ...`); this one "
                         f"sees {group.size()}")
    _start(group.rank())
    return group


def ranks_on_this_host() -> int:
    """How many ranks of the launched group share this process's host (1 when not launched
    as a group): the ring backend's hostfile (MLX_HOSTFILE, MLX_RANK) lists every rank's
    address."""
    import json

    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")  # Open MPI's mpirun says it
    if local and local.isdigit():
        return max(1, int(local))
    path, rank = os.environ.get("MLX_HOSTFILE"), os.environ.get("MLX_RANK")
    if not path or rank is None:
        return 1
    try:
        hosts = [h[0].rsplit(":", 1)[0] if isinstance(h, list) else str(h) for h in json.load(open(path))]
        return max(1, hosts.count(hosts[int(rank)]))
    except (OSError, ValueError, IndexError, TypeError):
        return 1


def timeout_seconds() -> float:
    raw = os.environ.get("FX_ENGINE_TP_TIMEOUT", "120")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"FX_ENGINE_TP_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"FX_ENGINE_TP_TIMEOUT must be positive, got {raw!r}")
    return value


def _start(rank: int) -> None:
    with _lock:
        if _watchdog:
            return
        limit = timeout_seconds()
        _rank[:] = [rank]

        def watch() -> None:
            while True:
                time.sleep(min(1.0, limit / 4))
                with _lock:
                    since = _busy_since[-1] if _busy_since else None
                if since is not None and time.monotonic() - since > limit:
                    _exit_lost(rank, f"a distributed step has not finished in {limit:.0f} s "
                                     "(FX_ENGINE_TP_TIMEOUT)")

        t = threading.Thread(target=watch, name="fx-tp-watchdog", daemon=True)
        t.start()
        _watchdog.append(t)


@contextlib.contextmanager
def busy(active: bool = True) -> Iterator[None]:
    """Mark a step in progress (watched when the watchdog runs; `active=False`: a no-op)."""
    if not active:
        yield
        return
    with _lock:
        _busy_since.append(time.monotonic())
    try:
        yield
    except RuntimeError as e:
        if _watchdog and peer_lost(e):
            _exit_lost(_rank[0] if _rank else -1, f"the step failed ({e})")
        raise
    finally:
        with _lock:
            _busy_since.pop()


def gathered(values: list[int]) -> list[list[int]]:
    """Every rank's `values` (integers, as many on every rank), in rank order."""
    import mlx.core as mx

    return mx.distributed.all_gather(mx.array([values], mx.int64)).tolist()


def broadcast(obj: Any, rank: int) -> Any:
    """Rank 0's `obj` on every rank (pickled; the group is one trusted program). Two
    all_sums: the length, then the bytes (other ranks add zeros)."""
    import pickle

    import mlx.core as mx
    import numpy as np

    data = pickle.dumps(obj) if rank == 0 else b""
    n = int(mx.distributed.all_sum(mx.array([len(data)], mx.int32)).item())
    buf = np.frombuffer(data, np.uint8) if rank == 0 else np.zeros(n, np.uint8)
    got = mx.distributed.all_sum(mx.array(buf))
    mx.eval(got)
    return obj if rank == 0 else pickle.loads(np.asarray(got).tobytes())
