"""Work beside the rows: step generators the engine's thread advances one call per step.

A job is a generator cut into bounded calls (`embeddings.embed_steps`: at most the step
token budget each) with the Future of its return value. `Engine.call_steps` queues it; each
engine step runs one call of the oldest job, which then goes last (round robin), so long
work never stalls the generating rows. A job stays queued while it runs (it counts as the
engine's work), and its Future stays pending until it ends: a consumer may cancel it at any
time, and the job is dropped at its next turn.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable, Generator

__all__ = ["JobQueue", "run_steps"]

Job = tuple[Generator[Any, None, Any], "concurrent.futures.Future"]


def run_steps(steps: Generator[Any, None, Any]) -> Any:
    """Run a step generator to its end, on the calling thread; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class JobQueue:
    """The queued jobs, under the engine's lock (the engine's thread waits on it for work)."""

    def __init__(self, lock: threading.Condition):
        self._lock = lock
        self._jobs: collections.deque[Job] = collections.deque()

    def __len__(self) -> int:  # (read under the lock by the engine)
        return len(self._jobs)

    def add(self, steps: Generator[Any, None, Any], fut: concurrent.futures.Future) -> None:
        """Queue a job; the caller holds the lock (and notifies the engine's thread)."""
        self._jobs.append((steps, fut))

    def run_one(self, trace: Callable[..., None]) -> None:
        """Advance the oldest job by one call (then it goes last); a cancelled one is closed
        without running further; an exception fails that job only."""
        with self._lock:
            if not self._jobs:
                return
            job = steps, fut = self._jobs[0]
        if fut.cancelled():
            steps.close()
            trace("job_cancelled")
            return self._requeue(job, False)
        t0 = time.perf_counter()
        try:
            tokens = next(steps)
        except StopIteration as stop:
            if fut.set_running_or_notify_cancel():
                fut.set_result(stop.value)
            return self._requeue(job, False)
        except Exception as e:  # this job only
            if fut.set_running_or_notify_cancel():
                fut.set_exception(e)
            return self._requeue(job, False)
        trace("job_step", tokens=tokens, seconds=time.perf_counter() - t0)
        self._requeue(job, True)

    def _requeue(self, job: Job, again: bool) -> None:
        """Take a job off the front of the queue; `again`: back at its end (its next turn)."""
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
                if again:
                    self._jobs.append(job)

    def drop(self, error: BaseException | None) -> None:
        """Cancel (error None) or fail every queued job."""
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
        for steps, fut in jobs:
            steps.close()
            if error is None:
                fut.cancel()
            elif fut.set_running_or_notify_cancel():
                fut.set_exception(error)
