"""The machine's DRAM read bandwidth, measured (issue 41): what a weight-streaming decode
step can reach at best. Shared by tools/bench_kernels.py and tools/bench.py.

Method ("numpy-reduce"): a 1 GiB array (32x a 32 MiB L3; every page written first), split
into one contiguous slice per thread (default: every CPU this process may run on, as the
kernels use); each thread runs numpy's `np.add.reduce` over its slice (numpy releases the
GIL in reductions) at the same time; bandwidth = bytes read / wall time of the slowest
thread, median of --reps. Reduced as int64 (an integer add per 8 bytes: far below the
memory's rate, so the read is what is timed) and, as a second opinion, float32.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def l3_bytes() -> int:
    """The largest data cache's size (lscpu's L3) from sysfs, 32 MiB if unknown."""
    from pathlib import Path

    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            txt = (idx / "size").read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(txt[-1], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            pass
    return best or 32 * 2**20


def dram_read_gbs(nbytes: int = 2**30, threads: int | None = None, reps: int = 7,
                  dtypes: tuple[str, ...] = ("int64", "float32")) -> dict[str, Any]:
    """{"gbs": the int64 figure, "method": ..., "by_dtype": {dtype: {"median", "runs"}}}."""
    import numpy as np

    threads = threads or _threads()
    raw = np.empty(nbytes, np.uint8)
    raw[:] = 1  # touch every page
    out: dict[str, Any] = {"bytes": nbytes, "threads": threads, "reps": reps, "by_dtype": {}}
    for dt in dtypes:
        a = raw.view(dt)
        step = -(-a.size // threads)
        parts = [a[i * step:(i + 1) * step] for i in range(threads)]
        runs = []
        for _ in range(reps + 1):  # the first: warm-up
            barrier = threading.Barrier(threads + 1)
            ends = [0.0] * threads

            def work(i: int) -> None:
                barrier.wait()
                np.add.reduce(parts[i])
                ends[i] = time.perf_counter()

            ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            t0 = time.perf_counter()
            barrier.wait()
            for t in ts:
                t.join()
            runs.append(nbytes / (max(ends) - t0) / 1e9)
        runs = runs[1:]
        out["by_dtype"][dt] = {"median": statistics.median(runs), "runs": runs}
    del raw
    out["gbs"] = out["by_dtype"][dtypes[0]]["median"]
    out["method"] = (f"numpy np.add.reduce as {dtypes[0]} over a {nbytes / 2**30:.0f} GiB array, "
                     f"{threads} thread(s) on contiguous slices at once, median of {reps}")
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(dram_read_gbs(), indent=1))
