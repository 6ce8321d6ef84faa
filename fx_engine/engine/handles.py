"""Request handles: the consumer's side of one submitted request (thread/async plumbing).

The engine thread delivers events (`_emit`) and the end (`_finish`); consumers wait for
them with one readiness check per kind of wait (`_next_ready`: the next event;
`_result_ready`: the Completion) and one wait loop (`_wait`) shared by iteration (`_next`)
and `result()`; the asyncio variants (`aiter`, `aresult`) run the same checks and only
block differently (awaiting a wake-up instead of a condition). Without a running engine
thread, waiting drives `engine.step()` on the waiting thread.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any, Callable, Iterator

from fx_engine.engine.request import Completion, TextDelta

__all__ = ["RequestHandle", "END"]

END = object()  # the end-of-stream sentinel delivered to listeners and returned by _next
_NOT_YET = object()  # a readiness check's "keep waiting"


class RequestHandle:
    """One submitted request. Iterate it for `TextDelta` events (a `str` with `.token_ids`,
    `.logprobs`; the last one has `.finish_reason` and `.usage`); `.result()` waits for the
    `Completion`; `.cancel()` cancels (finish_reason "cancelled", partial output kept).
    A failed request raises its error from iteration and from `.result()`."""

    def __init__(self, engine: Any, request_id: int, prompt_token_ids: tuple[int, ...]):
        self.id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.timings: dict[str, float] = {"submitted": time.perf_counter()}
        # with prompt_logprobs: the prompt tokens' records (request.TokenLogprob, None for the
        # first), set before the first event is emitted
        self.prompt_logprobs: tuple | None = None
        # prompt tokens restored from the prefix cache, set at admission (a streamed reply's
        # first event may report them: Anthropic's message_start does)
        self.cached_tokens = 0
        self._engine = engine
        self._cond = threading.Condition()
        self._events: collections.deque = collections.deque()
        self._notify: Callable[[], None] | None = None  # wakes an async consumer
        self._done = False
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._cancel = False

    # ---- called by the engine (its thread) ----
    def _deliver(self, ev: Any) -> None:
        """Queue one event for the consumer and wake it (under _cond). An async consumer's
        wake-up channel that fails (the asyncio loop of an `aiter()` closed) ends this
        request only: the notifier is dropped and the request cancelled; the engine and
        other requests never see it."""
        if ev is not END:
            self._events.append(ev)
        if self._notify is not None:
            try:
                self._notify()
            except Exception:
                self._notify = None
                self._cancel = True

    def _emit(self, ev: Any) -> None:
        with self._cond:
            self._deliver(ev)
            self._cond.notify_all()

    def _finish(self, completion: Completion | None, error: BaseException | None) -> None:
        with self._cond:
            self._completion, self._error, self._done = completion, error, True
            self._deliver(END)
            self._cond.notify_all()

    # ---- public ----
    @property
    def done(self) -> bool:
        return self._done

    @property
    def cancelled(self) -> bool:
        return self._done and self._completion is not None and self._completion.finish_reason == "cancelled"

    def cancel(self) -> None:
        """Ask the engine to cancel; the row is freed at the start of the next step."""
        self._cancel = True
        self._engine._wake()

    # ---- waiting: the one wait loop ----
    def _wait(self, ready: Callable[[], Any], timeout: float | None, what: str) -> Any:
        """Wait until `ready()` (called under _cond) returns something other than
        _NOT_YET, and return it. With the engine's thread running, wait on the condition
        (at most `timeout` seconds in all: TimeoutError naming `what`); without it, drive
        `engine.step()` on this thread between checks."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                out = ready()
                if out is not _NOT_YET:
                    return out
                if self._engine.running:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id}{what} within {timeout} s")
                    self._cond.wait(0.05 if left is None else min(0.05, left))
                    continue
            self._engine.step()

    def _next_ready(self) -> Any:
        """The next event, END once finished (raising a failed request's error), else
        _NOT_YET (under _cond)."""
        if self._events:
            return self._events.popleft()
        if self._done:
            if self._error is not None:
                raise self._error
            return END
        return _NOT_YET

    def _result_ready(self) -> Any:
        if self._done:
            if self._error is not None:
                raise self._error
            assert self._completion is not None
            return self._completion
        return _NOT_YET

    def _next(self, timeout: float | None) -> Any:
        return self._wait(self._next_ready, timeout, ": no event")

    def __iter__(self) -> Iterator[TextDelta]:
        while True:
            ev = self._next(None)
            if ev is END:
                return
            yield ev

    def result(self, timeout: float | None = None) -> Completion:
        return self._wait(self._result_ready, timeout, " not finished")

    async def aresult(self) -> Completion:
        """`result()` for asyncio code: awaits the Completion without blocking the loop."""
        async for _ in self.aiter():
            pass
        return self.result()

    async def aiter(self):
        """Async iteration: `async for delta in handle.aiter()`. The same readiness check as
        iteration (`_next_ready`); only the blocking differs: with a started engine the
        engine thread wakes this coroutine through loop.call_soon_threadsafe, otherwise
        this drives engine.step() on the event loop's thread between awaits."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        with self._cond:
            self._notify = lambda: loop.call_soon_threadsafe(wake.set)
        # The notifier stays registered when the consumer stops early: if its loop is then
        # closed, the next wake-up fails and cancels this request (see _deliver).
        while True:
            with self._cond:
                ev = self._next_ready()  # raises a failed request's error
            if ev is END:
                return
            if ev is not _NOT_YET:
                yield ev
                continue
            if not self._engine.running:
                self._engine.step()
                await asyncio.sleep(0)
                continue
            await wake.wait()
            wake.clear()
