"""Run N processes as one `mx.distributed` ring group on this machine, as `mlx.launch -n N
--backend ring` does (a hostfile of 127.0.0.1 ports, MLX_RANK / MLX_HOSTFILE per process),
but under the caller's control: each rank's exit code and output come back, and a group
that does not finish in time is killed (for tests and CI of tensor-parallel runs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from typing import Sequence

import attrs

__all__ = ["RankResult", "launch_local", "start_local", "wait_local"]


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
