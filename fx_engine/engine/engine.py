"""The continuous-batching engine: row membership, chunked prefill interleaved with decode,
cancellation, admission control, failure containment, trace events.

    engine = fx_engine.engine.engine.Engine(model, max_rows=8, prefill_chunk=512)
    with engine:                                  # start() a background thread; close() at exit
        h = engine.submit("Hello", max_tokens=32) # thread-safe; any thread
        for delta in h: print(delta, end="")      # TextDelta events (token ids, logprobs, ...)
        out = h.result()                          # the Completion fx_engine.generate returns

Without start(), iterating a handle or calling `.result()` drives `engine.step()` on the
calling thread; `engine.step()` can also be called directly. All MLX work happens on the one
thread that steps (MLX's compile cache is thread-local).

JetStream-style layout: each request is prefilled chunk by chunk on its own 1-row cache, its
first token sampled there, then its K/V (its `length` slots) and its DecodeState row are
inserted into a free row of the decode batch (`insert_row`, `insert_state_row`); one
`decode_step_compiled` per step advances every active row. Planning (which pieces, which
buckets, admission) is pure Python in `scheduler.py`; the policy is in specs/engine.md.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from fx_engine.core.cache import (KVCache, bytes_per_token, insert_row, resize, row_view, snapshot_row, span_bucket, stack_rows, take_rows, with_lengths)
from fx_engine.core.sampling import SamplingConfig, make_sampling_params
from fx_engine.core.state import DecodeState, init_state
from fx_engine.core.steps import (decode_step_compiled, prefill_step_compiled, sample_step_compiled, verify_step_compiled)
from fx_engine.core.tree import tree_leaves, tree_replace
from fx_engine.engine import scheduler as sched
from fx_engine.engine.prefix_cache import DiskTier, PrefixStore
from fx_engine.engine.request import (MAX_DRAFT_TOKENS, Completion, TextDelta, TokenLogprob, Usage, apply_processors, parse_request)
from fx_engine.engine.request import xtc_special_tokens as _xtc_special

__all__ = [
    "Engine", "RequestHandle", "QueueFull", "EngineClosed", "insert_row", "insert_state_row",
]

_GREEDY = SamplingConfig()
_END = object()


_STARTED: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def _close_at_exit(engine: "Engine") -> None:
    """Engines whose thread is still running when the interpreter exits (a script that
    never closed its engine) are stopped first: their requests are cancelled and their
    thread ends (releasing its MLX state, see Engine._end_thread) before finalization,
    instead of being frozen mid-step by it."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(_close_all)
        _ATEXIT_REGISTERED = True
    _STARTED.add(engine)


def _close_all() -> None:
    for engine in list(_STARTED):  # a step that never returns must not hang the exit
        engine.close(wait=False, timeout=30.0)
    _STARTED.clear()


class QueueFull(RuntimeError):
    """submit() found the engine's bounded wait queue full."""


class EngineClosed(RuntimeError):
    """submit() after close()."""


# --------------------------------------------------------------------------------------
# Pure row insertion helpers
# --------------------------------------------------------------------------------------


def _fit_cols(x: mx.array, width: int, fill: Any, left: bool) -> mx.array:
    """Pad [B, w] to [B, width] (w <= width), on the left (right-aligned history) or right."""
    pad = width - x.shape[1]
    if pad <= 0:
        return x
    return mx.pad(x, [(0, 0), (pad, 0) if left else (0, pad)], constant_values=fill)


def insert_state_row(
    state: DecodeState, row_state: DecodeState, row_index: int, params: Any
) -> DecodeState:
    """Put row 0 of `row_state` into row `row_index` of `state` (rows of other requests are
    unchanged), with `params` (the rebuilt per-row SamplingParams). The history width and the
    number of top logprobs widen to the larger of the two (history is right-aligned, -1 =
    empty, so widening is exact)."""
    w = max(state.history.shape[1], row_state.history.shape[1])
    n = max(state.n_top, row_state.n_top)

    def put(x: mx.array, y: mx.array) -> mx.array:
        start = mx.array([row_index] + [0] * (x.ndim - 1), mx.int32)
        return mx.slice_update(x, y[:1].astype(x.dtype), start, tuple(range(x.ndim)))

    return tree_replace(
        state,
        tokens=put(state.tokens, row_state.tokens),
        keys=put(state.keys, row_state.keys),
        history=put(_fit_cols(state.history, w, -1, True), _fit_cols(row_state.history, w, -1, True)),
        params=params,
        active=put(state.active, row_state.active),
        logprob=put(state.logprob, row_state.logprob),
        top_ids=put(_fit_cols(state.top_ids, n, 0, False), _fit_cols(row_state.top_ids, n, 0, False)),
        top_logprobs=put(
            _fit_cols(state.top_logprobs, n, 0.0, False), _fit_cols(row_state.top_logprobs, n, 0.0, False)
        ),
        n_top=n,
    )


def _take_state_rows(state: DecodeState, idx: mx.array, params: Any) -> DecodeState:
    return tree_replace(
        state, tokens=state.tokens[idx], keys=state.keys[idx], history=state.history[idx],
        params=params, active=state.active[idx], logprob=state.logprob[idx],
        top_ids=state.top_ids[idx], top_logprobs=state.top_logprobs[idx],
    )


def _pad_state_rows(state: DecodeState, rows: int, params: Any) -> DecodeState:
    def pad(x: mx.array, fill: Any) -> mx.array:
        extra = rows - x.shape[0]
        return mx.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)

    return tree_replace(
        state, tokens=pad(state.tokens, 0), keys=pad(state.keys, 0), history=pad(state.history, -1),
        params=params, active=pad(state.active, False), logprob=pad(state.logprob, 0.0),
        top_ids=pad(state.top_ids, 0), top_logprobs=pad(state.top_logprobs, 0.0),
    )


# --------------------------------------------------------------------------------------
# Requests and handles
# --------------------------------------------------------------------------------------


class RequestHandle:
    """One submitted request. Iterate it for `TextDelta` events (a `str` with `.token_ids`,
    `.logprobs`; the last one has `.finish_reason` and `.usage`); `.result()` waits for the
    `Completion`; `.cancel()` cancels (finish_reason "cancelled", partial output kept).
    A failed request raises its error from iteration and from `.result()`."""

    def __init__(self, engine: "Engine", request_id: int, prompt_token_ids: tuple[int, ...]):
        self.id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.timings: dict[str, float] = {"submitted": time.perf_counter()}
        self._engine = engine
        self._cond = threading.Condition()
        self._events: collections.deque = collections.deque()
        self._listener: Callable[[Any], None] | None = None
        self._done = False
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._cancel = False

    # ---- called by the engine (its thread) ----
    def _deliver(self, ev: Any) -> None:
        """Hand one event to the consumer (under _cond). A delivery channel that fails (the
        asyncio loop of an `aiter()` closed) ends this request only: the listener is
        dropped and the request cancelled; the engine and other requests never see it."""
        if self._listener is None:
            self._events.append(ev)
            return
        try:
            self._listener(ev)
        except Exception:
            self._listener = None
            self._cancel = True

    def _emit(self, ev: Any) -> None:
        with self._cond:
            self._deliver(ev)
            self._cond.notify_all()

    def _finish(self, completion: Completion | None, error: BaseException | None) -> None:
        with self._cond:
            self._completion, self._error, self._done = completion, error, True
            if self._listener is not None:
                self._deliver(_END)
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

    def _next(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                if self._done:
                    if self._error is not None:
                        raise self._error
                    return _END
                if self._engine.running:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id}: no event within {timeout} s")
                    self._cond.wait(0.05 if left is None else min(0.05, left))
                    continue
            self._engine.step()

    def __iter__(self) -> Iterator[TextDelta]:
        while True:
            ev = self._next(None)
            if ev is _END:
                return
            yield ev

    def result(self, timeout: float | None = None) -> Completion:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self._done:
                    if self._error is not None:
                        raise self._error
                    assert self._completion is not None
                    return self._completion
                if self._engine.running:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id} not finished within {timeout} s")
                    self._cond.wait(0.05 if left is None else min(0.05, left))
                    continue
            self._engine.step()

    async def aresult(self) -> Completion:
        """`result()` for asyncio code: awaits the Completion without blocking the loop."""
        async for _ in self.aiter():
            pass
        return self.result()

    async def aiter(self):
        """Async iteration: `async for delta in handle.aiter()`. With a started engine the
        events arrive through loop.call_soon_threadsafe; otherwise this drives engine.step()
        on the event loop's thread between awaits."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._cond:
            pending = list(self._events)
            self._events.clear()
            done = self._done
            if not done:
                self._listener = lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)
        for ev in pending:
            yield ev
        if not done:
            while True:
                if not self._engine.running and q.empty():
                    self._engine.step()
                    await asyncio.sleep(0)
                    continue
                ev = await q.get()
                if ev is _END:
                    break
                yield ev
        if self._error is not None:
            raise self._error


class _Request:
    """Engine-side per-request state (dropped when the request finishes)."""

    __slots__ = (
        "handle", "ids", "cfg", "max_tokens", "stops", "detok", "want_logprobs", "need",
        "prefilled", "pcache", "row", "cache_len", "generated", "text", "lps", "phase",
        "t_admit", "t_first", "row_state", "processors", "drafter", "row_drafter", "k_max",
        "k", "skip", "misses", "drafted", "accepted", "alpha", "cached", "salt",
    )

    def __init__(self, handle, ids, cfg, max_tokens, stops, want_logprobs, processors=(),
                 drafter=None, k_max=0, salt=None):
        self.handle = handle
        self.salt = salt  # the prefix-cache scope (cache_salt)
        self.ids = ids
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.stops = stops
        self.detok = None
        self.want_logprobs = want_logprobs
        self.need = len(ids) + max_tokens
        self.prefilled = 0
        self.pcache: KVCache | None = None
        self.row: int | None = None
        self.cache_len = 0
        self.generated: list[int] = []
        self.text: list[str] = []
        self.lps: list[TokenLogprob] = []
        self.phase = "queued"
        self.t_admit = 0.0
        self.t_first = 0.0
        self.row_state: DecodeState | None = None
        self.processors = processors
        # speculative decoding: the request's drafter, its per-row state, the adaptive draft
        # length (k <= k_max), steps left without drafting (back-off), counters for usage
        self.drafter = drafter
        self.row_drafter = None
        self.k_max = k_max
        self.k = k_max
        self.skip = 0
        self.misses = 0
        self.drafted = 0
        self.accepted = 0
        self.alpha = 0.6  # EMA of the per-token acceptance rate (a prior until measured)
        self.cached = 0  # prompt tokens restored from the prefix cache


# --------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------


class Engine:
    """Continuous batching over the pure steps. See the module docstring and specs/engine.md.

    max_rows: most requests admitted at once (prefilling + decoding); the decode batch uses
      row buckets 1, 2, 4, ... up to max_rows.
    kv_budget_tokens / kv_budget_bytes: bound on the KV memory of admitted requests: the
      rectangular decode cache (row bucket x capacity bucket of the largest prompt +
      max_tokens) plus the prefill caches of requests still prefilling; None = unbounded.
    prefill_chunk: largest prefill piece per request per step (rounded down to a power of 2).
    step_token_budget: tokens per step shared by decode rows (1 each) and prefill pieces
      (padded size); default prefill_chunk + max_rows; must be >= max_rows + 16.
    max_queue: most requests waiting for admission; submit beyond it raises QueueFull.
    trace_capacity: size of the `trace_events` ring buffer.
    fault_hook: testing hook, called as fault_hook(stage, handle) with stage "prefill" or
      "token" while processing one request; an exception fails that request only.
    prefix_cache_bytes / prefix_block_size: the in-memory prefix cache (on by default,
      512 MiB; 0 turns it off): prompts sharing a prefix with an earlier prompt or finished
      conversation restore its KV and prefill only the rest (usage.cached_tokens).
    prefix_cache_dir / prefix_cache_disk_bytes: a disk tier (safetensors files) that later
      processes restore from; bounded by its own budget (default 4 GiB).
    prefix_cache_entries: also bound the in-memory store's entry count (None: bytes only).
    kv_bits / kv_group_size / quantized_kv_start: the KV cache kind, as in mlx-lm (default:
      the model's, see `Model.with_kv_cache`). The KV budget counts bytes per position of
      the dense/quantized entries; sliding-window rings (models with sliding layers) are a
      fixed window + prefill_chunk slots per row on top.
    """

    def __init__(
        self,
        model: Any,
        max_rows: int = 8,
        kv_budget_tokens: int | None = None,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int = 512,
        step_token_budget: int | None = None,
        max_queue: int = 256,
        trace_capacity: int = 10_000,
        fault_hook: Callable[[str, RequestHandle], None] | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        quantized_kv_start: int | None = None,
        prefix_cache_bytes: int = 512 << 20,
        prefix_block_size: int = 16,
        prefix_cache_dir: str | None = None,
        prefix_cache_disk_bytes: int = 4 << 30,
        prefix_cache_entries: int | None = None,
    ):
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
        if kv_budget_tokens is not None and kv_budget_bytes is not None:
            raise ValueError("give kv_budget_tokens or kv_budget_bytes, not both")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        if (kv_bits, kv_group_size, quantized_kv_start) != (None, None, None):
            model = model.with_kv_cache(
                kv_bits if kv_bits is not None else model.kv_bits,
                kv_group_size if kv_group_size is not None else model.kv_group_size,
                quantized_kv_start if quantized_kv_start is not None else model.quantized_kv_start,
            )
        self.model = model
        self.params = model.params
        # Reuse of shared prompt prefixes (0 bytes: off). See engine/prefix_cache.py.
        self.prefix_cache = None
        c = model.config
        self._c = c
        self._dtype = model.cache_dtype  # the KV cache's element type
        # Ring entries need headroom for the longest step: a prefill chunk or a verify.
        self._headroom = max(sched.normalize_chunk(prefill_chunk), MAX_DRAFT_TOKENS)
        self.cache_layout = model.cache_layout(self._headroom)
        if prefix_cache_bytes or prefix_cache_dir:
            disk = None if prefix_cache_dir is None else DiskTier(
                prefix_cache_dir, prefix_cache_disk_bytes, model.fingerprint,
                model.tokenizer.fingerprint(), self.cache_layout, str(self._dtype).split(".")[-1],
                prefix_block_size)
            self.prefix_cache = PrefixStore(prefix_cache_bytes, prefix_block_size, disk,
                                            prefix_cache_entries)
        self.bytes_per_token = bytes_per_token(self.cache_layout, self._dtype)
        self._float_bytes_per_token = bytes_per_token(
            model.with_kv_cache(None).cache_layout(self._headroom), self._dtype)
        if kv_budget_bytes is not None:
            if kv_budget_bytes <= 0:
                raise ValueError(f"kv_budget_bytes must be > 0, got {kv_budget_bytes!r}")
            kv_budget_tokens = int(kv_budget_bytes // self.bytes_per_token)
        if kv_budget_tokens is not None and kv_budget_tokens <= 0:
            raise ValueError(f"kv_budget_tokens must be > 0, got {kv_budget_tokens!r}")
        self.max_rows = max_rows
        self.kv_budget_tokens = kv_budget_tokens
        self.prefill_chunk = sched.normalize_chunk(prefill_chunk)
        if step_token_budget is None:
            step_token_budget = self.prefill_chunk + max_rows
        if step_token_budget < max_rows + sched.MIN_CHUNK:
            raise ValueError(
                f"step_token_budget must be >= max_rows + {sched.MIN_CHUNK} "
                f"({max_rows + sched.MIN_CHUNK}), got {step_token_budget}"
            )
        self.step_token_budget = step_token_budget
        self.max_queue = max_queue
        self.context_length = c.max_position_embeddings
        self.eos = frozenset(model.eos_ids)
        self._special = list(_xtc_special(model))
        self._known = model.tokenizer.vocab_size  # ids past it (padded vocab) decode to ""
        self.fault_hook = fault_hook
        self.trace_events: collections.deque = collections.deque(maxlen=trace_capacity)

        self._lock = threading.Condition()
        self._pending: collections.deque[_Request] = collections.deque()  # under _lock
        self._closing = False
        self._abort = False
        self._thread: threading.Thread | None = None
        self._step_lock = threading.Lock()
        self._next_id = 0
        self.steps = 0
        # Measured step costs (EMA seconds) per (row bucket, K); K = 0 is a decode step.
        # Speculation is chosen per step from these (see _choose_k).
        self._cost: dict[tuple[int, int], float] = {}
        self._draft_seconds = 0.0  # EMA of the drafters' time per speculating step

        # engine-thread state
        self._prefilling: list[_Request] = []
        self._prefill_calls = 0  # prefill_step calls so far (the `call` of prefill events)
        self._rows: list[_Request | None] = []
        self._cache: KVCache | None = None
        self._state: DecodeState | None = None
        self._active_dirty = False

    # ---------------------------------------------------------------- public API
    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def submit(self, prompt: Any, **kwargs: Any) -> RequestHandle:
        """Queue a request (thread-safe). Takes fx_engine.generate's arguments. Raises
        ValueError for invalid arguments or a request that can never fit (context, KV
        budget), QueueFull when the wait queue is full, EngineClosed after close()."""
        return self.submit_many(prompt, [kwargs])[0]

    def submit_many(self, prompt: Any, kwargs_list: Sequence[dict[str, Any]]) -> list[RequestHandle]:
        """Queue several requests on one prompt as a unit (a server request's `n`
        choices, each with its own arguments): every one is validated before any is
        queued, and all are queued or none (QueueFull unless the queue has room for all),
        so a rejected request never leaves rows running. The prompt is tokenized once."""
        if not kwargs_list:
            raise ValueError("submit_many: no requests")
        if len(kwargs_list) > max(1, self.max_queue):  # could never be queued: not a retry-later
            raise ValueError(f"n: {len(kwargs_list)} requests at once exceed the engine's "
                             f"queue of {self.max_queue}")
        made = []
        for kw in kwargs_list:
            made.append(self._make_request(prompt if not made else made[0][1], kw))
        with self._lock:
            if self._closing:
                raise EngineClosed("engine is closed")
            if len(self._pending) + len(made) > self.max_queue:
                raise QueueFull(
                    f"engine queue is full ({len(self._pending)} of {self.max_queue} requests "
                    f"waiting, {len(made)} more asked); retry later"
                )
            handles = []
            for req, ids in made:
                handle = RequestHandle(self, self._next_id, tuple(ids))
                self._next_id += 1
                req.handle = handle
                self._pending.append(req)
                handles.append(handle)
            self._lock.notify_all()
        return handles

    def start(self) -> "Engine":
        """Run steps on a background thread (it owns all MLX state from now on)."""
        with self._lock:
            if self._closing:
                raise EngineClosed("engine is closed")
            if self.running:
                return self
            self._thread = threading.Thread(target=self._loop, name="fx-engine", daemon=True)
            self._thread.start()
        _close_at_exit(self)
        return self

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests. wait=True finishes the submitted ones first; False
        cancels them. Joins the background thread (at most `timeout` seconds)."""
        with self._lock:
            self._closing = True
            if not wait:
                self._abort = True
            self._lock.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        elif t is None:
            while self.has_work():
                self.step()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, exc_type, *exc: Any) -> None:
        self.close(wait=exc_type is None)

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._pending)
        return pending or bool(self._prefilling) or any(r is not None for r in self._rows)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            queued = len(self._pending)
        cache = self._cache
        pcaches = [pc for r in list(self._prefilling) if (pc := r.pcache) is not None]
        return {
            "queued": queued,
            "prefilling": len(self._prefilling),
            "decoding": sum(r is not None for r in self._rows),
            "rows": len(self._rows),
            "capacity": 0 if cache is None else cache.capacity,
            "cache_bytes": 0 if cache is None else cache.nbytes,
            "prefill_cache_bytes": sum(c.nbytes for c in pcaches),
            "prefill_cache_slots": sum(c.capacity for c in pcaches),
            # the KV cache kind's cost per position (dense/quantized entries) and what a
            # float cache would cost: the memory kv_bits saves
            "kv_bytes_per_token": self.bytes_per_token,
            "kv_bytes_per_token_float": self._float_bytes_per_token,
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats(),
            "steps": self.steps,
        }

    # ---------------------------------------------------------------- submission
    def _make_request(self, prompt: Any, kw: dict[str, Any]) -> tuple[_Request, list[int]]:
        # The same validation as fx_engine.generate (prefill_chunk is an engine setting here).
        r = parse_request(self.model, prompt, **kw)
        ids, max_tokens = r.ids, r.max_tokens
        need = len(ids) + max_tokens
        pslots = sched.prefill_slots(len(ids), self.prefill_chunk)
        if not sched.ever_fits(need, self.max_rows, self.kv_budget_tokens, pslots):
            slots = sched.kv_footprint([need], self.max_rows, [pslots])
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) needs a KV cache "
                f"of {slots} token slots ({int(slots * self.bytes_per_token)} bytes: its decode "
                f"row and its prefill cache), more than the KV budget of "
                f"{self.kv_budget_tokens} tokens"
            )
        return _Request(None, ids, r.sampling, max_tokens, r.stops, r.n_top > 0,
                        r.processors, r.drafter, r.num_draft_tokens, r.cache_salt), ids

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._pending or self._prefilling or self._live_rows()
                               or self._closing):
                        self._lock.wait()
                    if self._closing and not (self._abort or self._pending or self._prefilling
                                              or self._live_rows()):
                        return
                try:
                    self.step()
                except BaseException as e:  # a step-level failure: fail every request, go on
                    self._fail_all(e)
                if self._abort and not self.has_work():
                    return
        finally:
            self._end_thread()

    def _end_thread(self) -> None:
        """Release this thread's MLX state while it is still a Python thread.

        MLX keeps a compile cache (and streams) per OS thread; the cache's entries hold
        the Python step functions. Left alone, they are destroyed by the thread's C++
        thread-local destructors, which run after the Python thread has ended and need
        the GIL: if the interpreter is finalizing by then (a script that closes its
        engine and exits), taking the GIL ends the thread by a forced unwind through a
        noexcept destructor, and the process aborts ("terminate called without an
        active exception", exit code 134). `mx.clear_streams()` destroys them now; no
        MLX work may follow on this thread, so the engine's arrays (all evaluated) are
        dropped first and the engine is finished."""
        with self._lock:
            self._closing = True
        self._fail_all(EngineClosed("engine is closed"))
        mx.clear_streams()

    def _live_rows(self) -> bool:
        return any(r is not None for r in self._rows)

    def _trace(self, kind: str, t: float | None = None, **fields: Any) -> None:
        self.trace_events.append({"t": time.perf_counter() if t is None else t, "step": self.steps,
                                  "kind": kind, **fields})

    # ---------------------------------------------------------------- one step
    def step(self) -> bool:
        """One engine step: retire cancelled requests, admit, run at most
        step_token_budget tokens of prefill pieces, one decode step over the batch.
        Returns whether there is still work."""
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            raise RuntimeError("engine.step() is driven by the background thread; do not call it")
        with self._step_lock:
            self._step()
        return self.has_work()

    def _step(self) -> None:
        t0 = time.perf_counter()
        self.steps += 1
        if self._abort:
            self._cancel_everything()
        self._retire_cancelled()
        self._admit()

        decoding = [r for r in self._rows if r is not None]
        calls = sched.group_prefill(
            len(decoding),
            [(i, len(r.ids) - r.prefilled, self._prefill_slots(r)) for i, r in enumerate(self._prefilling)],
            self.prefill_chunk, self.step_token_budget, self.max_rows,
        )
        # resolved before any call runs: a call can retire requests (errors, a first token
        # that finishes), which shifts the indices
        calls = [(size, [(self._prefilling[i], n) for i, n in members]) for size, members in calls]
        finished_prefill: list[_Request] = []
        for size, pieces in calls:
            finished_prefill += self._prefill_call(size, pieces)
        for req in finished_prefill:
            if req.phase == "prefill":  # not finished by its first token
                self._prefilling.remove(req)
                self._insert(req)

        if any(r is not None for r in self._rows):
            self._decode()
        self._maintain()
        self._trace("step", seconds=time.perf_counter() - t0)

    # ---------------------------------------------------------------- admission
    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                req = self._pending[0]
                needs = [r.need for r in self._prefilling] + [r.need for r in self._rows if r is not None]
                prefilling = [self._prefill_slots(r) for r in self._prefilling]
                if not sched.can_admit(needs, req.need, self.max_rows, self.kv_budget_tokens,
                                       prefilling, self._prefill_slots(req)):
                    return
                self._pending.popleft()
            req.phase = "prefill"
            req.t_admit = time.perf_counter()
            req.handle.timings["admitted"] = req.t_admit
            req.detok = self.model.tokenizer.detokenizer()
            self._prefilling.append(req)
            self._restore_prefix(req)
            self._trace("admit", request=req.handle.id, prompt_tokens=len(req.ids),
                        max_tokens=req.max_tokens, cached_tokens=req.cached)

    # ---------------------------------------------------------------- prefix cache
    def _restore_prefix(self, req: _Request) -> None:
        """Start the request's prefill cache from the longest cached prefix of its prompt
        (fx_engine/engine/prefix_cache.py); only the rest is prefilled."""
        if self.prefix_cache is None:
            return
        try:
            entry, m = self.prefix_cache.lookup(req.ids, req.salt)
            if entry is None:
                return
            cache = self.model.new_cache(1, self._prefill_slots(req), headroom=self._headroom)
            req.pcache = self.prefix_cache.restore(entry, cache, m)
            req.prefilled = req.cached = m
        except Exception as e:  # a broken entry must never break the request: go cold
            req.pcache, req.prefilled, req.cached = None, 0, 0
            self._trace("prefix_error", request=req.handle.id, error=repr(e))

    def _snapshot(self, req: _Request, tokens: Sequence[int], cache: KVCache, row: int) -> None:
        """Keep this row's first len(tokens) positions for later requests with the same
        cache_salt (a copy of those tokens only, made now: the source cache is updated in
        place afterwards)."""
        if self.prefix_cache is None or len(tokens) < 1:
            return
        try:
            self.prefix_cache.add(tokens, snapshot_row(cache, row, len(tokens)), salt=req.salt)
        except Exception as e:
            self._trace("prefix_error", error=repr(e))

    # ---------------------------------------------------------------- prefill
    def _prefill_call(self, size: int, pieces: list[tuple[_Request, int]]) -> list[_Request]:
        """One `prefill_step` over len(pieces) rows of `size` tokens (each request's 1-row
        prefill cache stacked into one, then split back into views); returns the requests
        whose prompt it finished (first token sampled). A failure fails only the requests
        of this call."""
        ok = []
        for req, n in pieces:
            try:
                if self.fault_hook is not None:
                    self.fault_hook("prefill", req.handle)
                ok.append((req, n))
            except Exception as e:
                self._fail(req, e)
        if len(ok) != len(pieces):  # keep power-of-two row counts (bounded compile shapes)
            out, at = [], 0
            for rows in sched.pow2_splits(len(ok)):
                part = ok[at : at + rows]
                at += rows
                out += self._prefill_rows(max(sched.chunk_bucket(n) for _, n in part), part)
            return out
        return self._prefill_rows(size, ok)

    def _prefill_rows(self, size: int, pieces: list[tuple[_Request, int]]) -> list[_Request]:
        if not pieces:
            return []
        reqs = [r for r, _ in pieces]
        try:
            cap = self._prefill_slots(reqs[0])
            if all(r.pcache is None for r in reqs):
                cache = self.model.new_cache(len(reqs), cap, headroom=self._headroom)
            else:
                cache = stack_rows([r.pcache if r.pcache is not None
                                    else self.model.new_cache(1, cap, headroom=self._headroom)
                                    for r in reqs])
            for r in reqs:
                r.pcache = None  # the call owns the only reference (in-place K/V writes)
            starts = [r.prefilled for r in reqs]
            tokens = [r.ids[s : s + n] + [0] * (size - n) for (r, n), s in zip(pieces, starts)]
            t0 = time.perf_counter()
            logits, cache = prefill_step_compiled(
                self.params, cache, mx.array(tokens, mx.int32),
                mx.array([n for _, n in pieces], mx.int32),
                span=span_bucket(max(starts) + size, cap),
            )
            host = time.perf_counter() - t0  # graph build + call; the rest is evaluation
            mx.eval(logits, *tree_leaves(cache))
            t1 = time.perf_counter()
            self._prefill_calls += 1
        except Exception as e:
            for r in reqs:
                self._fail(r, e)
            return []
        finished = []
        for i, ((req, n), start) in enumerate(zip(pieces, starts)):
            try:
                req.pcache = row_view(cache, i)
                req.prefilled = start + n
                # one event per row, all with the call's id, end time and duration
                self._trace("prefill", t=t1, request=req.handle.id, tokens=n, padded=size,
                            start=start, rows=len(pieces), call=self._prefill_calls,
                            seconds=t1 - t0, host_seconds=host)
                if req.prefilled < len(req.ids):
                    self._snapshot(req, req.ids[: req.prefilled], req.pcache, 0)  # a chunk boundary
                else:
                    self._first_token(req, logits[i : i + 1])
                    finished.append(req)
            except Exception as e:
                self._fail(req, e)
        return finished

    def _first_token(self, req: _Request, logits: mx.array) -> None:
        """Sample the first token of a request whose prompt is prefilled (a 1-row state:
        per-row keys, so the draw does not depend on the call's other rows)."""
        c = self._c
        row_state = init_state([req.cfg], [req.ids], c.vocab_size, special_token_ids=self._special)
        logits = apply_processors(req.processors, req.ids, logits)
        row_state = sample_step_compiled(row_state, logits)
        mx.eval(*tree_leaves(row_state))
        self._snapshot(req, req.ids, req.pcache, 0)  # the whole prompt
        t1 = time.perf_counter()
        self._trace("sample", request=req.handle.id)
        req.t_first = t1
        req.handle.timings["first_token"] = t1
        req.cache_len = len(req.ids)
        token = int(row_state.tokens[0].item())
        lp = None
        if req.want_logprobs:
            lp = self._logprob(req, token, float(row_state.logprob[0].item()),
                               row_state.top_ids[0].tolist(), row_state.top_logprobs[0].tolist())
        req.row_state = row_state
        self._on_token(req, token, lp)

    def _prefill_slots(self, req: _Request) -> int:
        return sched.prefill_slots(len(req.ids), self.prefill_chunk)

    # ---------------------------------------------------------------- insertion
    def _row_params(self) -> Any:
        cfgs = [r.cfg if r is not None else _GREEDY for r in self._rows]
        return make_sampling_params(cfgs, self._c.vocab_size, self._special)

    def _insert(self, req: _Request) -> None:
        row_state, req.row_state = req.row_state, None
        try:
            if self._cache is None:
                self._resize_rows(1, capacity=sched.capacity_bucket(req.cache_len + 1))
            self._ensure_capacity(req.cache_len + 1)
            row = self._free_row()
            self._rows[row] = req
            req.row = row
            params = self._row_params()
            self._cache = insert_row(self._cache, req.pcache, row, req.cache_len)
            self._state = insert_state_row(self._state, row_state, row, params)
            req.pcache = None
            req.phase = "decode"
            mx.eval(*tree_leaves(self._cache), *tree_leaves(self._state))
        except Exception as e:
            self._fail(req, e)
            return
        self._trace("insert", request=req.handle.id, row=row, rows=len(self._rows),
                    capacity=self._cache.capacity)

    def _free_row(self) -> int:
        for i, r in enumerate(self._rows):
            if r is None:
                return i
        live = len(self._rows)
        new_rows = sched.row_bucket(live + 1, self.max_rows)
        self._resize_rows(new_rows)
        return live

    def _resize_rows(self, rows: int, capacity: int = sched.MIN_CAPACITY) -> None:
        c = self._c
        old = len(self._rows)
        self._rows = self._rows + [None] * (rows - old)
        if self._cache is None:
            self._cache = self.model.new_cache(rows, capacity, headroom=self._headroom)
            self._state = init_state([_GREEDY] * rows, [[0]] * rows, c.vocab_size, self._special)
            self._state = tree_replace(self._state, active=mx.zeros((rows,), mx.bool_))
        else:
            self._cache = resize(self._cache, rows=rows)
            self._state = _pad_state_rows(self._state, rows, self._row_params())
        self._trace("resize", rows=rows, capacity=self._cache.capacity)

    def _ensure_capacity(self, needed: int) -> None:
        if self._cache is None or needed <= self._cache.capacity:
            return
        cap = sched.capacity_bucket(needed)
        budget = self.kv_budget_tokens
        if budget is not None and len(self._rows) * cap > budget:
            live = sum(r is not None for r in self._rows)
            self._compact(sched.row_bucket(live, self.max_rows))
        self._cache = resize(self._cache, capacity=cap)
        self._trace("resize", rows=len(self._rows), capacity=cap)

    # ---------------------------------------------------------------- decode
    def _decode(self) -> None:
        live = [r for r in self._rows if r is not None]
        if not any(r.processors for r in live) and any(r.drafter is not None for r in live):
            # Ask drafters only when speculating is expected to pay (their work is not free),
            # then decide again with the drafts actually proposed.
            plan = self._plan_drafts(live)
            if plan:
                t0 = time.perf_counter()
                drafts = self._propose(plan)
                self._draft_seconds = 0.7 * self._draft_seconds + 0.3 * (time.perf_counter() - t0)
                live = [r for r in self._rows if r is not None]  # a drafter may fail its row
                k = self._choose_k({r: len(t) for r, (t, _) in drafts.items()}, len(live)) if drafts else 0
                if k:
                    return self._decode_speculative(
                        {r: (t[:k], None if p is None else p[:k]) for r, (t, p) in drafts.items()}, k)
            if not live:
                return
        max_len = max(r.cache_len for r in live)
        self._ensure_capacity(max_len + 1)  # may compact: row indices are read after it
        active = [r is not None for r in self._rows]
        state = tree_replace(self._state, active=mx.array(active))
        self._state = None
        span = span_bucket(max_len + 1, self._cache.capacity)
        t0 = time.perf_counter()
        traces = decode_step_compiled.traces
        failed: dict[int, BaseException] = {}
        if any(r.processors for r in live):
            state, cache = self._decode_with_processors(state, span, failed)
        else:  # the fast path: forward and sampling in one compiled step
            state, cache = decode_step_compiled(self.params, self._cache, state, span=span)
        host = time.perf_counter() - t0
        self._cache = None
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
        self._state, self._cache = state, cache
        toks = state.tokens.tolist()
        want_lp = any(r.want_logprobs for r in live)
        if want_lp:
            lps, top_ids, top_vals = state.logprob.tolist(), state.top_ids.tolist(), state.top_logprobs.tolist()
        seconds = time.perf_counter() - t0
        if decode_step_compiled.traces == traces and not failed:
            self._observe(0, seconds)
        self._trace("decode", batch=len(live), rows=len(self._rows), capacity=cache.capacity,
                    span=span, requests=[r.handle.id for r in live], seconds=seconds,
                    host_seconds=host)
        for row, req in enumerate(self._rows):
            if req is None:
                continue
            req.cache_len += 1
            if row in failed:  # its logits processor raised: this request only
                self._fail(req, failed[row])
                continue
            try:
                tok = toks[row]
                lp = None
                if req.want_logprobs:
                    lp = self._logprob(req, tok, lps[row], top_ids[row], top_vals[row])
                self._on_token(req, tok, lp)
            except Exception as e:
                self._fail(req, e)

    # ---------------------------------------------------------------- speculation
    def _plan_drafts(self, live: list[_Request]) -> dict[_Request, int]:
        """How many tokens to ask each speculating row for this step ({}: do not draft).
        Rows with XTC never speculate; rows backing off skip; the draft length is the row's
        adaptive k, capped by what it may still generate."""
        plan = {}
        for req in live:
            if req.drafter is None or req.cfg.xtc_probability > 0:
                continue
            if req.skip > 0:  # backing off after drafts that kept failing
                req.skip -= 1
                continue
            k = min(req.k, req.max_tokens - len(req.generated) - 1)
            if k > 0:
                plan[req] = k
        if plan and not self._choose_k(plan, len(live), self._draft_seconds):
            return {}
        return plan

    def _propose(self, plan: dict[_Request, int]) -> dict[_Request, Any]:
        """Ask each planned row's drafter for up to k tokens. A drafter that raises or
        returns something malformed fails its own request only. Draft-model distributions
        over another vocabulary size are trimmed/zero-padded to the target's, and a draft
        stops at the first token the target's vocabulary does not have."""
        out: dict[_Request, Any] = {}
        vocab = self._c.vocab_size
        for req, k in plan.items():
            try:
                if req.row_drafter is None:
                    req.row_drafter = req.drafter.new_row(list(req.ids), req.cfg)
                d = req.row_drafter.propose(list(req.ids) + req.generated, k)
                toks = tuple(getattr(d, "tokens", ()))
                probs = getattr(d, "probs", None)
                if len(toks) > k or any(not isinstance(t, int) or t < 0 for t in toks):
                    raise ValueError(f"drafter proposed {toks!r}: expected at most {k} "
                                     "non-negative token ids")
                if probs is not None and (probs.ndim != 2 or probs.shape[0] != len(toks)):
                    raise ValueError(f"drafter probs must have shape [{len(toks)}, vocab], "
                                     f"got {tuple(probs.shape)}")
            except Exception as e:
                self._fail(req, e)
                continue
            n = next((i for i, t in enumerate(toks) if t >= vocab), len(toks))
            toks = toks[:n]
            if probs is not None:
                probs = probs[:n, :vocab]
                if probs.shape[1] < vocab:
                    probs = mx.pad(probs, [(0, 0), (0, vocab - probs.shape[1])])
            if toks:
                out[req] = (toks, probs)
        return out

    def _decode_speculative(self, drafts: dict[_Request, Any], k: int) -> None:
        """One verify step over the whole batch: rows with drafts verify them, the others
        decode (n_draft = 0 samples as a decode step does)."""
        live = [r for r in self._rows if r is not None]
        # Room for each row's own drafts (padding goes to the sink); may compact the rows,
        # so row indices are read after it.
        needed = max(r.cache_len + len(drafts.get(r, ((), None))[0]) + 1 for r in live)
        self._ensure_capacity(needed)
        b = len(self._rows)
        arr = [[0] * k for _ in range(b)]
        n = [0] * b
        for req, (toks, _) in drafts.items():
            arr[req.row][: len(toks)] = toks
            n[req.row] = len(toks)
        probs = None
        if any(p is not None for _, p in drafts.values()):
            v = self._c.vocab_size
            rows = []
            for row in range(b):
                req = self._rows[row]
                toks, p = drafts.get(req, ((), None)) if req is not None else ((), None)
                if p is None:  # deterministic drafts: a point mass on each token
                    p = mx.zeros((len(toks), v)) if not toks else (
                        mx.arange(v)[None, :] == mx.array(toks)[:, None]).astype(mx.float32)
                rows.append(mx.pad(p.astype(mx.float32), [(0, k - p.shape[0]), (0, 0)]))
            probs = mx.stack(rows)
        state = tree_replace(self._state, active=mx.array([r is not None for r in self._rows]))
        self._state = None
        max_len = max(r.cache_len for r in live)
        span = span_bucket(max_len + k + 1, self._cache.capacity)
        t0 = time.perf_counter()
        traces = verify_step_compiled.traces
        state, cache, res = verify_step_compiled(
            self.params, self._cache, state, mx.array(arr, mx.int32), mx.array(n, mx.int32),
            probs, span=span)
        host = time.perf_counter() - t0
        self._cache = None
        mx.eval(*tree_leaves(state), *tree_leaves(cache), *tree_leaves(res))
        self._state, self._cache = state, cache
        toks, counts, acc = res.tokens.tolist(), res.count.tolist(), res.accepted.tolist()
        if any(r.want_logprobs for r in live):
            lps, top_ids, top_vals = res.logprobs.tolist(), res.top_ids.tolist(), res.top_logprobs.tolist()
        seconds = time.perf_counter() - t0
        if verify_step_compiled.traces == traces:
            self._observe(k, seconds)
        self._trace("verify", batch=len(live), rows=b, k=k, drafted=sum(n), accepted=sum(acc),
                    capacity=cache.capacity, span=span, requests=[r.handle.id for r in live],
                    seconds=seconds, host_seconds=host)
        for row, req in enumerate(self._rows):
            if req is None:
                continue
            req.cache_len += counts[row]
            if n[row]:
                self._adapt(req, n[row], acc[row])
            try:
                for i in range(counts[row]):
                    lp = None
                    if req.want_logprobs:
                        lp = self._logprob(req, toks[row][i], lps[row][i], top_ids[row][i], top_vals[row][i])
                    if self._on_token(req, toks[row][i], lp):
                        break
            except Exception as e:
                self._fail(req, e)

    def _observe(self, k: int, seconds: float) -> None:
        key = (len(self._rows), k)
        old = self._cost.get(key)
        self._cost[key] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def _step_cost(self, k: int) -> float | None:
        """Expected seconds of a step with K = k (0: decode) at the current row bucket:
        measured, else the decode cost times 1 + k/4 (the measured order on CPU: a verify
        of K=4 costs 1.75-1.9x a decode step, docs/benchmarks.md)."""
        rows = len(self._rows)
        c = self._cost.get((rows, k))
        if c is not None:
            return c
        base = self._cost.get((rows, 0))
        return None if base is None else base * (1 + k / 4)

    def _choose_k(self, lengths: dict[_Request, int], live: int, extra: float = 0.0) -> int:
        """Speculate only when it pays: pick the K bucket maximising expected tokens per
        second, (live rows + expected accepted drafts) / (cost(K) + extra), and verify only
        if that beats plain decoding's live / cost(0). `lengths`: each drafting row's draft
        length; expected accepted drafts of a row with n tokens and per-token acceptance a:
        a + a^2 + ... + a^n. `extra`: the drafters' expected time (before proposing).
        Returns 0 for a plain decode step (also until a decode step has been timed)."""
        base = self._step_cost(0)
        if base is None:
            return 0
        best_k, best = 0, live / base
        longest = sched.pow2_ceil(max(lengths.values()))
        k = 1
        while k <= longest:
            cost = self._step_cost(k) + extra
            gain = live
            for req, n in lengths.items():
                a = req.alpha
                gain += sum(a ** i for i in range(1, min(k, n) + 1))
            if gain / cost > best * 1.02:
                best_k, best = k, gain / cost
            k *= 2
        return best_k

    @staticmethod
    def _adapt(req: _Request, drafted: int, accepted: int) -> None:
        """Per-row draft length: double after a fully accepted draft, else just past what
        was accepted; two fully rejected drafts in a row back off (skip 2, 4, ... up to 64
        steps of plain decoding) so a row whose drafts keep failing stops paying for them."""
        req.drafted += drafted
        req.accepted += accepted
        req.alpha = 0.7 * req.alpha + 0.3 * (accepted / drafted)
        if accepted == drafted:
            req.k = min(req.k_max, 2 * req.k)
        else:
            req.k = max(1, accepted + 1)
        if accepted:
            req.misses = 0
        else:
            req.misses += 1
            if req.misses >= 2:
                req.skip = min(64, 2 ** (req.misses - 1))

    def _decode_with_processors(
        self, state: DecodeState, span: int, failed: dict[int, BaseException]
    ) -> tuple[DecodeState, KVCache]:
        """decode_step split in two around the rows' logits processors: the forward (a
        one-token prefill_step), the processors eagerly per row, then sample_step. A row
        whose processor raises keeps its unprocessed logits and is failed by the caller;
        the other rows are unaffected."""
        logits, cache = prefill_step_compiled(
            self.params, self._cache, state.tokens[:, None], state.active.astype(mx.int32),
            span=span,
        )
        self._cache = None
        rows = [logits[i : i + 1] for i in range(logits.shape[0])]
        for i, req in enumerate(self._rows):
            if req is None or not req.processors:
                continue
            try:
                rows[i] = apply_processors(req.processors, req.ids + req.generated, rows[i])
                mx.eval(rows[i])
            except Exception as e:
                failed[i] = e
        return sample_step_compiled(state, mx.concatenate(rows, axis=0)), cache

    def _logprob(self, req: _Request, token: int, value: float, ids: Sequence[int],
                 vals: Sequence[float]) -> tuple[TokenLogprob, ...]:
        known, decode = self._known, self.model.tokenizer.decode
        dec = lambda ids: decode(ids) if ids[0] < known else ""  # noqa: E731
        n = req.cfg.logprobs
        top = tuple((int(i), dec([int(i)]), float(v)) for i, v in list(zip(ids, vals))[:n])
        return (TokenLogprob(token, dec([token]), float(value), top),)

    # ---------------------------------------------------------------- per-token shell logic
    def _on_token(self, req: _Request, token: int, lp: Any) -> bool:
        """Stops, detokenization, events for one sampled token. Returns True if finished."""
        if self.fault_hook is not None:
            self.fault_hook("token", req.handle)
        if token in self.eos:
            self._complete(req, "stop")
            return True
        req.generated.append(token)
        text = req.stops.feed(req.detok.add(token) if token < self._known else "")
        if lp:
            req.lps.extend(lp)
        req.text.append(text)
        req.handle._emit(TextDelta(text, (token,), lp))
        if req.stops.stopped:
            self._complete(req, "stop")
            return True
        if len(req.generated) >= req.max_tokens:
            self._complete(req, "length")
            return True
        return False

    def _complete(self, req: _Request, reason: str) -> None:
        if req.row is not None and self._cache is not None and self._rows[req.row] is req:
            # the conversation so far (prompt + generated tokens in the cache) for later turns
            self._snapshot(req, (list(req.ids) + req.generated)[: req.cache_len], self._cache,
                           req.row)
        if reason == "stop" and req.stops.stopped:
            tail = ""
        else:
            tail = req.stops.feed(req.detok.finalize()) if req.detok is not None else ""
        tail += req.stops.flush()
        req.text.append(tail)
        now = time.perf_counter()
        t_first = req.t_first or now
        usage = Usage(
            prompt_tokens=len(req.ids), completion_tokens=len(req.generated),
            cached_tokens=req.cached,
            prompt_seconds=(t_first - req.t_admit) if req.t_admit else 0.0,
            generation_seconds=now - t_first,
            drafted_tokens=req.drafted, accepted_tokens=req.accepted,
        )
        h = req.handle
        h.timings["finished"] = now
        completion = Completion(
            text="".join(req.text), token_ids=tuple(req.generated), finish_reason=reason,
            logprobs=tuple(req.lps) if req.want_logprobs else None, usage=usage,
            prompt_token_ids=tuple(req.ids),
        )
        self._release(req, reason)
        h._emit(TextDelta(tail, (), None, reason, usage))
        h._finish(completion, None)

    def _fail(self, req: _Request, error: BaseException) -> None:
        if req.phase == "done":
            return
        self._release(req, "error", error=repr(error))
        req.handle.timings["finished"] = time.perf_counter()
        req.handle._finish(None, error)

    def _release(self, req: _Request, reason: str, **fields: Any) -> None:
        """Retire: free the row (inactive, length 0) or drop the prefill state."""
        phase, req.phase = req.phase, "done"
        if phase == "prefill" and req in self._prefilling:
            self._prefilling.remove(req)
        if req.row is not None and self._rows and self._rows[req.row] is req:
            row = req.row
            self._rows[row] = None
            if self._cache is not None:
                mask = mx.arange(len(self._rows)) == row
                self._cache = with_lengths(self._cache, mx.where(mask, 0, self._cache.lengths))
        req.pcache = None
        self._trace("retire", request=req.handle.id, row=req.row, reason=reason,
                    generated=len(req.generated), **fields)
        req.row = None

    def _retire_cancelled(self) -> None:
        with self._lock:
            gone = [r for r in self._pending if r.handle._cancel]
            for r in gone:
                self._pending.remove(r)
        for r in gone:
            r.phase = "queued"
            self._complete(r, "cancelled")
        for r in list(self._prefilling) + [r for r in self._rows if r is not None]:
            if r.handle._cancel and r.phase != "done":
                self._complete(r, "cancelled")

    def _cancel_everything(self) -> None:
        with self._lock:
            for r in self._pending:
                r.handle._cancel = True
        for r in list(self._prefilling) + [r for r in self._rows if r is not None]:
            r.handle._cancel = True

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for r in pending + list(self._prefilling) + [r for r in self._rows if r is not None]:
            if r.phase != "done":
                self._fail(r, error)
        self._cache, self._state, self._rows, self._prefilling = None, None, [], []

    # ---------------------------------------------------------------- memory upkeep
    def _compact(self, target: int) -> None:
        """Gather the live rows into rows 0..live-1 of a `target`-row batch (a copy)."""
        rows = len(self._rows)
        live_idx = [i for i, r in enumerate(self._rows) if r is not None]
        spare = [r for r in range(rows) if r not in live_idx]
        idx = live_idx + spare[: max(0, target - len(live_idx))]
        gather = mx.array(idx, mx.int32)
        self._cache = take_rows(self._cache, gather)
        self._rows = [self._rows[i] for i in live_idx] + [None] * (len(idx) - len(live_idx))
        for i, r in enumerate(self._rows):
            if r is not None:
                r.row = i
        self._state = _take_state_rows(self._state, gather, self._row_params())
        mask = mx.arange(len(idx)) >= len(live_idx)
        self._cache = with_lengths(self._cache, mx.where(mask, 0, self._cache.lengths))
        if len(idx) < target:
            self._resize_rows(target)
        self._trace("compact", rows=len(self._rows), live=len(live_idx))

    def _maintain(self) -> None:
        if self._cache is None:
            return
        live_idx = [i for i, r in enumerate(self._rows) if r is not None]
        if not live_idx:
            if not self._prefilling:
                self._cache, self._state, self._rows = None, None, []
                self._trace("resize", rows=0, capacity=0)
            return
        rows = len(self._rows)
        target = sched.shrink_rows_target(len(live_idx), rows, self.max_rows)
        budget = self.kv_budget_tokens
        over = budget is not None and rows * self._cache.capacity > budget
        if target is None and over:
            target = sched.row_bucket(len(live_idx), self.max_rows)
        if target is not None and (target < rows or live_idx != list(range(len(live_idx)))):
            self._compact(target)
        max_len = max(r.cache_len for r in self._rows if r is not None)
        cap = sched.shrink_capacity_target(max_len, self._cache.capacity)
        if cap is not None:
            self._cache = resize(self._cache, capacity=cap)
            self._trace("resize", rows=len(self._rows), capacity=cap)
