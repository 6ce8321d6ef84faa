"""Run N processes as one `mx.distributed` ring group on this machine, as `mlx.launch -n N
--backend ring` does (a hostfile of 127.0.0.1 ports, MLX_RANK / MLX_HOSTFILE per process),
but under the caller's control: each rank's exit code and output come back, and a group
that does not finish in time is killed (for tests and CI of tensor-parallel runs)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

import attrs

__all__ = ["RankResult", "launch_local", "launch_mpi", "mpi_rank_pid", "mpirun", "start_local", "start_mpi",
           "wait_local", "wait_mpi"]


@attrs.frozen
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_local(n: int, argv: Sequence[str], env: dict[str, str] | None = None,
                stdin: bool = False) -> list[subprocess.Popen]:
    """Start `argv` as ranks 0..n-1 of a ring group over 127.0.0.1 (stdout and stderr
    piped; stdin: rank 0's stdin piped too, the others' empty); `wait_local` collects them."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{_free_port()}"] for _ in range(n)], f)
        hostfile = f.name  # read by each rank at mx.distributed.init(); left in the temp dir
    base = {**os.environ, **(env or {}), "MLX_HOSTFILE": hostfile}
    return [subprocess.Popen(list(argv), env={**base, "MLX_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.PIPE if stdin and r == 0 else subprocess.DEVNULL)
            for r in range(n)]


def launch_local(n: int, argv: Sequence[str], timeout: float = 300.0,
                 env: dict[str, str] | None = None, input: str | None = None) -> list[RankResult]:
    """Start `argv` as ranks 0..n-1 of a ring group over 127.0.0.1; wait for all (at most
    `timeout` seconds in total, then kill the rest). input: rank 0's stdin. Returns one
    RankResult per rank."""
    return wait_local(start_local(n, argv, env, stdin=input is not None), timeout, input)


def wait_local(procs: list[subprocess.Popen], timeout: float = 300.0,
               input: str | None = None) -> list[RankResult]:
    """Wait for started ranks (at most `timeout` seconds in total, then kill the rest). Every
    rank's pipes are read at once (a rank blocked on a full pipe would stall the group)."""
    import concurrent.futures

    t0 = time.monotonic()

    def wait(r: int) -> RankResult:
        p = procs[r]
        try:
            so, se = p.communicate(input if r == 0 and p.stdin is not None else None, timeout=timeout)
            return RankResult(r, p.returncode, so, se, time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            return RankResult(r, None, so, se, time.monotonic() - t0)

    try:
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            return list(pool.map(wait, range(len(procs))))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def mpirun() -> str | None:
    """Open MPI's `mpirun` (None: not installed). MPI is the MLX backend with subgroups,
    which tensor x pipeline runs need (the ring backend has none)."""
    return shutil.which("mpirun")


def start_mpi(n: int, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` as n ranks of an MPI group on this machine (`mpirun -np n`, in a session
    of its own; MLX picks its MPI backend there); mpirun merges the ranks' output (piped)."""
    exe = mpirun()
    if exe is None:
        raise FileNotFoundError("mpirun not found: install Open MPI (Debian: openmpi-bin libopenmpi-dev)")
    cmd = [exe, "--oversubscribe", "-np", str(n)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return subprocess.Popen(cmd + list(argv), env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def wait_mpi(p: subprocess.Popen, timeout: float = 300.0, t0: float | None = None) -> RankResult:
    """Wait for a `start_mpi` group (at most `timeout` seconds, then kill it all): one
    RankResult (rank -1) for the whole group, its returncode None at the timeout. mpirun
    fails when any rank does."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        so, se = p.communicate(timeout=timeout)
        return RankResult(-1, p.returncode, so, se, time.monotonic() - t0)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # (mpirun and the ranks it started)
        so, se = p.communicate()
        return RankResult(-1, None, so, se, time.monotonic() - t0)


def mpi_rank_pid(p: subprocess.Popen, rank: int, timeout: float = 60.0) -> int:
    """The process id of rank `rank` of a `start_mpi` group (Open MPI sets
    OMPI_COMM_WORLD_RANK in each rank's environment), to signal one rank alone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parents = {}
        for d in os.listdir("/proc"):
            try:  # (the command may hold spaces and parentheses: the fields after the last ")")
                parents[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        for pid in parents:
            up, seen = parents.get(pid), 0
            while up not in (None, 0, 1, p.pid) and seen < 64:
                up, seen = parents.get(up), seen + 1
            if up != p.pid:
                continue  # (not started by this mpirun)
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
                return pid
        time.sleep(0.2)
    raise TimeoutError(f"rank {rank} of the MPI group did not start in {timeout:.0f} s")


def launch_mpi(n: int, argv: Sequence[str], timeout: float = 300.0,
               env: dict[str, str] | None = None) -> RankResult:
    """Run `argv` as n ranks of an MPI group on this machine and wait (`start_mpi`,
    `wait_mpi`)."""
    t0 = time.monotonic()
    return wait_mpi(start_mpi(n, argv, env), timeout, t0)
