"""The continuous-batching engine: the request queue, the thread, the step's lifecycle.

    engine = fx_engine.engine.engine.Engine(model, max_rows=8, prefill_chunk=512)
    with engine:                                  # start() a background thread; close() at exit
        h = engine.submit("Hello", max_tokens=32) # thread-safe; any thread
        for delta in h: print(delta, end="")      # TextDelta events (token ids, logprobs, ...)
        out = h.result()                          # the Completion fx_engine.generate returns

Without start(), iterating a handle or calling `.result()` drives `engine.step()` on the
calling thread; `engine.step()` can also be called directly. All MLX work happens on the one
thread that steps (MLX's compile cache is thread-local). The policy is in specs/engine.md.

A step reads plan -> execute -> emit, one module per responsibility:

* `scheduler.py` plans, as plain data, in three phases (each needs what the previous one
  did): the intake (retirements, admissions), the prefill calls with their splits, the
  decode or verify (per-row K and drafts, grammar masks to fill, cache growth);
  `budget.py` holds the KV budget admission works against; `speculation.py` is the
  speculation policy (which rows draft, K);
* `executor.py` executes: prefix restores, prefill calls, first tokens, decode and verify
  steps on the pure steps and the decode batch (`batch.py`); grammar masks come from
  `constraints.py`, drafts from `drafters.py`;
* `emit.py` emits: decode and verify return one `StepResult`, one loop turns it into each
  request's events (`output.py`: detokenizing, stops, logprobs) and finishes requests;
* `lockstep.py`: tensor- and pipeline-parallel engines (rank 0 broadcasts each step's plan
  with the request records it needs; the other ranks only execute: `follow()`).

What stays here: submission (validation, tokenizing, the bounded queue), the thread and the
engine's lifecycle (start, close, fork and exit safety), the step's orchestration of the
phases above, cancellation and failing everything on a step-level error, stats and trace
events.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import threading
import time
import weakref
from typing import Any, Callable, Generator, Sequence

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache
from fx_engine.engine import scheduler as sched
from fx_engine.engine.batch import DecodeBatch, insert_state_row
from fx_engine.engine.budget import KVBudget, with_kv_cache_kind
from fx_engine.engine.constraints import RowGrammar, grammar_tokenizer
from fx_engine.engine.drafters import speculate
from fx_engine.engine.emit import Emitter
from fx_engine.engine.executor import Executor, LogitsProcessorError
from fx_engine.engine.handles import RequestHandle
from fx_engine.engine.image_prompt import (EncoderCache, ImagePrompt, engine_image_prompt, from_portable, has_images,
                                           portable, whole_images)
from fx_engine.engine.jobs import JobQueue, run_steps
from fx_engine.engine.kv_rows import insert_row
from fx_engine.engine.lockstep import (Ranks, RankMismatch, StepMessage, by_key, check_drafts, draft_ref, follow_step,
                                      lead_step, request_record, spmd_seed, take_records)
from fx_engine.engine.output import TokenOutput
from fx_engine.engine.prefix_cache import engine_store
from fx_engine.engine.request import MAX_DRAFT_TOKENS, parse_request
from fx_engine.engine.request import xtc_special_tokens as _xtc_special
from fx_engine.engine.request_state import RequestState
from fx_engine.engine.speculation import SpeculationPolicy
from fx_engine.runtime.distributed import busy, timeout_seconds

__all__ = [
    "Engine", "RequestHandle", "QueueFull", "EngineClosed", "EngineForked", "LogitsProcessorError",
    "RankMismatch", "insert_row", "insert_state_row",
]

_Request = RequestState  # (the engine's per-request record: engine/request_state.py)

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


def _weak_method(method: Callable[..., None]) -> Callable[..., None]:
    """A callable that calls `method` while its object lives (and does nothing after)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> None:
        m = ref()
        if m is not None:
            m(*args, **kwargs)
    return call


class QueueFull(RuntimeError):
    """submit() found the engine's bounded wait queue full."""


class EngineClosed(RuntimeError):
    """submit() after close()."""


class EngineForked(RuntimeError):
    """The Engine is used in a fork()ed child of the process that created it: its thread,
    locks and MLX state (MLX's stream threads) exist only in the parent, so any work there
    would hang."""



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
    lockstep / drafts: a tensor- or pipeline-parallel engine whose requests reach rank 0
      only (the other ranks `follow()`), and the draft models every rank loaded, in the same
      order (engine/lockstep.py).
    encoder_cache_bytes: a multimodal model's image encodings kept by image content (an
      image sent again is not re-encoded; engine/image_prompt.EncoderCache; 0: none).
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
        lockstep: bool = False,
        drafts: Sequence[Any] = (),
        encoder_cache_bytes: int = 256 << 20,
    ):
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
        if kv_budget_tokens is not None and kv_budget_bytes is not None:
            raise ValueError("give kv_budget_tokens or kv_budget_bytes, not both")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.model = model = with_kv_cache_kind(model, kv_bits, kv_group_size, quantized_kv_start)
        self.params = model.params
        # Lockstep: a request's draft goes to the other ranks as its place in this list.
        self._drafts: list[Any] = check_drafts(drafts)
        c = model.config
        # Ring entries need headroom for the longest step: a prefill chunk or a verify.
        self._headroom = max(sched.normalize_chunk(prefill_chunk), MAX_DRAFT_TOKENS)
        self.cache_layout = model.cache_layout(self._headroom)
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.prefix_cache = engine_store(model, self.cache_layout, prefix_cache_bytes, prefix_block_size,
                                         prefix_cache_dir, prefix_cache_disk_bytes, prefix_cache_entries)
        self.prefill_chunk = sched.normalize_chunk(prefill_chunk)
        self.budget = KVBudget.of_model(model, self.cache_layout, self._headroom, max_rows,
                                        self.prefill_chunk, kv_budget_tokens, kv_budget_bytes)
        self.max_rows = max_rows
        self.step_token_budget = sched.step_budget(step_token_budget, self.prefill_chunk, max_rows)
        self.max_queue = max_queue
        self.context_length = getattr(model, "context_length", c.max_position_embeddings)
        self.eos = frozenset(model.eos_ids)
        self._special = list(_xtc_special(model))
        self.trace_events: collections.deque = collections.deque(maxlen=trace_capacity)

        self._pid = os.getpid()  # the only process that may use it (see _check_process)
        self._lock = threading.Condition()
        self._pending: collections.deque[_Request] = collections.deque()  # under _lock
        self._jobs = JobQueue(self._lock)  # work beside the rows (embeddings), one call a step
        self._closing = False
        self._abort = False
        # Tensor or pipeline parallelism (model.ranks > 1): every rank's engine runs the same
        # steps on the same rows (engine/lockstep.py).
        self._ranks = Ranks.of_model(model, lockstep, self.budget, self.prefix_cache)
        # lockstep rank 0 steps at least this often (an empty step when idle), so the other
        # ranks' watchdog tells a dead rank 0 from an idle one
        self._heartbeat = timeout_seconds() / 4 if self._ranks is not None and self._ranks.leads else None
        self._thread: threading.Thread | None = None
        self._step_lock = threading.Lock()
        self._next_id = 0
        self.steps = 0
        # The speculation cost model: measured step costs per (row bucket, K), K chosen
        # per step from them (engine/speculation.py).
        self._spec = SpeculationPolicy()

        # engine-thread state: the prefilling requests (one list for the engine's life) and
        # the decode batch: its rows (requests), KVCache and DecodeState (engine/batch.py)
        # (its trace callback holds the engine weakly: no reference cycle, so an engine
        # nobody holds is freed at once with its caches, not at the next garbage collection)
        self._prefilling: list[_Request] = []
        trace = _weak_method(self._trace)
        self._batch = DecodeBatch(model, self._headroom, c.vocab_size, self._special, max_rows,
                                  self.budget.tokens, trace)  # (rank 0's when sharded)
        self._emitter = Emitter(self._batch, self._prefilling, self.prefix_cache, trace)
        self._executor = Executor(model, self._batch, self._headroom, self._special, self.budget,
                                  self._emitter, self.prefix_cache, self._spec, self._ranks, trace)
        self.fault_hook = fault_hook

    @property
    def _cache(self) -> KVCache | None:
        """The decode batch's cache (None: no batch)."""
        return self._batch.cache

    @property
    def fault_hook(self) -> Callable[[str, RequestHandle], None] | None:
        """The testing hook (see the class docstring); the executor and the emitter call it."""
        return self._executor.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, RequestHandle], None] | None) -> None:
        self._executor.fault_hook = self._emitter.fault_hook = hook

    # the KV budget's figures (engine/budget.py), as attributes of the engine
    kv_budget_tokens = property(lambda self: self.budget.tokens)
    bytes_per_token = property(lambda self: self.budget.bytes_per_token)
    state_bytes_per_row = property(lambda self: self.budget.state_bytes_per_row)

    # ---------------------------------------------------------------- public API
    def _check_process(self) -> None:
        """EngineForked in a fork()ed child: checked before any lock is taken (one held by
        the parent's engine thread at the fork is held forever in the child)."""
        if os.getpid() != self._pid:
            raise EngineForked(
                f"this Engine was created in process {self._pid} and cannot be used in its "
                f"fork()ed child {os.getpid()} (its thread and MLX state exist only in the "
                "parent, and MLX hangs in a fork()ed child): start child processes with "
                "multiprocessing's 'spawn' or 'forkserver' method")

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
        self._check_process()
        if not kwargs_list:
            raise ValueError("submit_many: no requests")
        if len(kwargs_list) > max(1, self.max_queue):  # could never be queued: not a retry-later
            raise ValueError(f"n: {len(kwargs_list)} requests at once exceed the engine's "
                             f"queue of {self.max_queue}")
        if self._ranks is not None and self._ranks.follows:
            raise RuntimeError(f"rank {self._ranks.rank} follows rank 0 (lockstep): submit requests on "
                               "rank 0; call engine.follow() here")
        image = None
        if isinstance(prompt, ImagePrompt) or has_images(prompt):  # encoded once for the n choices
            image = self._image_prompt(prompt)
            prompt = image.ids
        made = []
        for kw in kwargs_list:
            made.append(self._make_request(prompt if not made else made[0][1], kw, image))
        if self._ranks is not None and self._ranks.leads:  # what the other ranks will be sent
            for (req, ids), kw in zip(made, kwargs_list):
                req.record = request_record(ids, self._draft_ref(kw), req.cfg.seed,
                                            None if image is None else portable(image))
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
                if req.record is not None:
                    req.record = attrs.evolve(req.record, id=handle.id)
                self._pending.append(req)
                handles.append(handle)
            self._lock.notify_all()
        return handles

    def call(self, fn: Callable[[], Any]) -> "concurrent.futures.Future":
        """Run `fn()` on the thread that owns the engine's MLX state, at a step (work that
        is not a generated row); returns its Future: a one-call `call_steps` job (long
        work should be cut into steps there instead, so it never stalls the rows)."""
        def once() -> Generator[int, None, Any]:
            return fn()
            yield 0  # (a generator: its one call is its first next())
        return self.call_steps(once())

    def call_steps(self, steps: Generator[Any, None, Any]) -> "concurrent.futures.Future":
        """Run a step generator (`embeddings.embed_steps`: work cut into bounded calls) on
        the engine's thread, one `next()` per engine step beside the step's prefill and
        decode (several generators take turns), so long work never stalls the generating
        rows; returns a Future of its return value. `future.cancel()` works until it ends:
        the generator is dropped at the next step. Without a started engine it runs whole
        now, on the calling thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._ranks is not None:  # work outside the steps would run on one rank only
            raise ValueError("not available with tensor parallelism (work outside the engine's "
                             "steps, e.g. embeddings)")
        self._check_process()
        with self._lock:
            if self._closing:
                raise EngineClosed("engine is closed")
            if self.running:
                self._jobs.add(steps, fut)
                self._lock.notify_all()
                return fut
        try:
            fut.set_result(run_steps(steps))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def start(self) -> "Engine":
        """Run steps on a background thread (it owns all MLX state from now on)."""
        self._check_process()
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
        cancels them. Joins the background thread (at most `timeout` seconds). In a fork()ed
        child it does nothing (the engine belongs to the parent; exit handlers call this)."""
        if os.getpid() != self._pid:
            return
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
            self._stop_followers()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, exc_type, *exc: Any) -> None:
        self.close(wait=exc_type is None)

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._pending or self._jobs)
        return pending or bool(self._prefilling) or self._batch.any_live()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            queued, jobs = len(self._pending), len(self._jobs)
        batch = self._batch
        cache, rows = batch.cache, batch.rows
        pcaches = [pc for r in list(self._prefilling) if (pc := r.pcache) is not None]
        return {
            "queued": queued,
            "jobs": jobs,  # step generators in progress (embedding requests)
            "prefilling": len(self._prefilling),
            "decoding": sum(r is not None for r in rows),
            "rows": len(rows),
            "capacity": 0 if cache is None else cache.capacity,
            "cache_bytes": 0 if cache is None else cache.nbytes,
            "prefill_cache_bytes": sum(c.nbytes for c in pcaches),
            "prefill_cache_slots": sum(c.capacity for c in pcaches),
            # the KV cache kind's cost per position (dense/quantized entries) and what a
            # float cache would cost: the memory kv_bits saves
            "kv_bytes_per_token": self.bytes_per_token,
            "state_bytes_per_row": self.state_bytes_per_row,  # recurrent layers (fixed per row)
            "kv_bytes_per_token_float": self.budget.float_bytes_per_token,
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats(),
            "steps": self.steps,
        }

    # ---------------------------------------------------------------- submission
    def _draft_ref(self, kw: dict[str, Any]) -> dict[str, Any]:
        """A lockstep request's arguments with its draft model as a lockstep.DraftRef."""
        return draft_ref(self._drafts, kw)

    def _image_prompt(self, messages: Any) -> ImagePrompt:
        """Chat messages with images: their prompt and image rows (image_prompt.engine_image_prompt)."""
        return engine_image_prompt(self.model, messages,
                                   prefill_chunk=self.prefill_chunk, step_token_budget=self.step_token_budget,
                                   max_rows=self.max_rows, cache=self.encoder_cache)

    def _make_request(self, prompt: Any, kw: dict[str, Any],
                      image: ImagePrompt | None = None) -> tuple[_Request, list[int]]:
        """Validate and tokenize (the same validation as fx_engine.generate; prefill_chunk
        is an engine setting here) and build the request's record, in the caller's thread.
        image: the prompt's images (then `prompt` is its ids)."""
        if self._ranks is not None and not self._ranks.lockstep and kw.get("seed") is None:
            kw = {**kw, "seed": spmd_seed()}
        if image is not None:
            kw = {k: v for k, v in kw.items() if k not in ("chat", "chat_template")}
        r = parse_request(self.model, prompt, **kw)
        ids, max_tokens = r.ids, r.max_tokens
        self.budget.check_fits(len(ids), max_tokens)
        out = TokenOutput(self.model.tokenizer, self.eos, r.stops, max_tokens, r.n_top > 0,
                          r.sampling.logprobs)
        grammar = None
        if r.constraint is not None:
            grammar = RowGrammar(r.constraint, grammar_tokenizer(
                self.model.tokenizer, self.model.config.vocab_size, self.eos))
        salt = r.cache_salt
        if r.adapter is not None:
            # the prefix-cache scope of an adapter's rows: its contents' fingerprint (never
            # shared with the base or another adapter; stable across restarts for the disk tier)
            salt = f"\x00adapter:{r.adapter.fingerprint}\x00{salt or ''}"
        req = _Request(None, ids, r.sampling, max_tokens, out, r.processors, r.drafter,
                       r.num_draft_tokens, salt, grammar)
        req.image = image
        req.slot = 0 if r.adapter is None else r.adapter.slot
        if r.prompt_logprobs is not None:
            req.plp = r.prompt_logprobs
            out.prompt_lps = [None]  # the first token has no context
        return req, ids

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._pending or self._prefilling or self._batch.any_live()
                               or self._closing or self._jobs):
                        if not self._lock.wait(self._heartbeat):
                            break  # lockstep rank 0, idle: an empty step tells the others it lives
                    if self._closing and not (self._abort or self._pending or self._prefilling
                                              or self._batch.any_live() or self._jobs):
                        return
                try:
                    self.step()
                except BaseException as e:  # a step-level failure: fail every request, go on
                    self._fail_all(e)
                    if self._ranks is not None:
                        # the other ranks may not have failed alike: their steps no longer
                        # match this rank's, so this engine stops (they stop at its next
                        # message, or their watchdog ends them)
                        with self._lock:
                            self._closing = self._abort = True
                        return
                if self._abort and not self.has_work():
                    return
        finally:
            self._stop_followers()
            self._end_thread()

    def _stop_followers(self) -> None:
        ranks = self._ranks
        if ranks is not None and ranks.leads and not ranks.stopped:
            ranks.stopped = True
            with self._step_lock, busy(True):
                ranks.send(StepMessage(stop=True))

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

    def _trace(self, kind: str, t: float | None = None, **fields: Any) -> None:
        self.trace_events.append({"t": time.perf_counter() if t is None else t, "step": self.steps,
                                  "kind": kind, **fields})

    # ---------------------------------------------------------------- one step
    def step(self) -> bool:
        """One engine step: retire cancelled requests, admit, run at most
        step_token_budget tokens of prefill pieces, one decode step over the batch.
        Returns whether there is still work."""
        self._check_process()  # (a handle waited on in a fork()ed child drives this)
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            raise RuntimeError("engine.step() is driven by the background thread; do not call it")
        with self._step_lock:
            if self._ranks is not None and self._ranks.stopped:
                return False
            # a sharded engine: a lost rank is an error, not a hang (the other ranks of a
            # lockstep engine wait here for rank 0, which steps at least every heartbeat)
            with busy(self._ranks is not None):
                self._step()
        return self.has_work()

    def follow(self) -> None:
        """Tensor-parallel ranks other than 0 of a lockstep engine: run every step rank 0
        runs, on the requests rank 0 sends, until rank 0 closes its engine."""
        if self._ranks is None or not self._ranks.follows:
            raise RuntimeError("follow(): only for ranks > 0 of a lockstep tensor-parallel engine")
        while not self._ranks.stopped:
            self.step()
        self._fail_all(EngineClosed("rank 0 closed the engine"))

    def _step(self) -> None:
        """Plan -> execute -> emit, phase by phase (scheduler.py): the intake (retire the
        cancelled, admit), the prefill calls, the decode or verify; then the batch's upkeep
        (`scheduler.plan_maintenance`). Lockstep: rank 0 sends its plans as it makes them
        (`lockstep.lead_step`), the other ranks receive and only execute them
        (`lockstep.follow_step`)."""
        t0 = time.perf_counter()
        ranks = self._ranks
        if ranks is not None and ranks.follows:
            msg = ranks.receive()
            if msg.stop:  # rank 0 closed its engine
                ranks.stopped = True
                return
            self.steps += 1
            plan = follow_step(ranks, msg, self._queue_record, self._run_intake)
        else:
            self._jobs.run_one(self._trace)  # one bounded call of long work (embeddings)
            self.steps += 1
            intake, records = self._plan_intake()
            if ranks is not None and ranks.leads:
                plan = lead_step(ranks, records, intake, self._restores(intake), self._run_intake,
                                 self._plan_prefill)
            else:
                self._run_intake(intake)
                plan = self._plan_prefill(intake)
        self._executor.run_prefill(plan, self._prefilling, None if ranks is None else ranks.rank)
        if self._batch.any_live():
            self._decode()
        self._batch.maintain(bool(self._prefilling))
        self._trace("step", seconds=time.perf_counter() - t0)

    # ---------------------------------------------------------------- phase 1: intake
    def _plan_intake(self) -> tuple[sched.Intake, tuple]:
        """The step's retirements and admissions (`scheduler.plan_intake`), and, on lockstep
        rank 0, the records of the requests queued since the last step (taken under the
        same lock: every request the plan names is sent with it or before)."""
        records: tuple = ()
        with self._lock:
            pending = list(self._pending)
            if self._ranks is not None and self._ranks.leads:
                records = take_records(pending)
        admitted = [*self._prefilling, *self._batch.live()]
        cancelled = [r.handle.id for r in pending + admitted if self._abort or r.handle._cancel]
        if not (pending or cancelled or self._abort):
            return sched.NO_INTAKE, records  # (most decode steps: nothing to retire or admit)
        slots = self.budget.prefill_slots
        intake = sched.plan_intake(
            ((r.handle.id, r.need, slots(len(r.ids))) for r in pending),
            [(r.handle.id, r.need, slots(len(r.ids)) if r.phase == "prefill" else 0) for r in admitted],
            cancelled, self.max_rows, self.budget.tokens, self._abort)
        return intake, records

    def _restores(self, intake: sched.Intake) -> bool:
        """Whether the intake's admissions restore prefixes (which needs every rank)."""
        if self.prefix_cache is None or not intake.admit:
            return False
        admit = set(intake.admit)
        with self._lock:
            return any(r.plp is None for r in self._pending if r.handle.id in admit)

    def _queue_record(self, rec: Any) -> None:
        """A follower: make rank 0's request from its record, queued under rank 0's id."""
        image = None if rec.image is None else from_portable(rec.image)
        req, ids = self._make_request(list(rec.ids), self._ranks.resolve_draft(self._drafts, rec.kwargs), image)
        with self._lock:
            req.handle = RequestHandle(self, rec.id, tuple(ids))
            self._next_id = max(self._next_id, rec.id + 1)
            self._pending.append(req)

    def _run_intake(self, intake: sched.Intake) -> None:
        """Retire the cancelled requests (a cancelled row is free within one step), then
        admit: each admitted request starts prefilling from its longest cached prefix."""
        if intake.abort:
            self._abort = True
            self._cancel_everything()
        if not (intake.retire or intake.admit):
            return
        with self._lock:
            queued = {r.handle.id: r for r in self._pending}
            gone = [queued[k] for k in intake.retire if k in queued]
            for r in gone:
                self._pending.remove(r)
            admit = list(by_key(self._pending, intake.admit, self._ranks and self._ranks.rank).values())
            for r in admit:
                self._pending.remove(r)
        for r in gone:
            r.phase = "queued"
            self._emitter.complete(r, "cancelled")
        admitted = {r.handle.id: r for r in [*self._prefilling, *self._batch.live()]}
        for k in intake.retire:
            r = admitted.get(k)
            if r is not None and r.phase != "done":
                r.handle._cancel = True
                self._emitter.complete(r, "cancelled")
        for req in admit:
            req.phase = "prefill"
            req.t_admit = time.perf_counter()
            req.handle.timings["admitted"] = req.t_admit
            req.out.detok = self.model.tokenizer.detokenizer()
            self._prefilling.append(req)
            self._executor.restore_prefix(req)
            req.handle.cached_tokens = req.cached  # known now, long before the usage at the end
            self._trace("admit", request=req.handle.id, prompt_tokens=len(req.ids),
                        max_tokens=req.max_tokens, cached_tokens=req.cached)

    def _cancel_everything(self) -> None:
        self._jobs.drop(None)
        with self._lock:
            for r in self._pending:
                r.handle._cancel = True
        for r in list(self._prefilling) + self._batch.live():
            r.handle._cancel = True

    # ---------------------------------------------------------------- phase 2: prefill
    def _plan_prefill(self, intake: sched.Intake) -> sched.StepPlan:
        """The step's prefill calls (`scheduler.plan_step`) over the prefilling requests,
        by request id, around the rows decoding now."""
        prefilling = self._prefilling
        return sched.plan_step(
            sum(r is not None for r in self._batch.rows),
            [(r.handle.id, len(r.ids) - r.prefilled if r.image is None else
              whole_images(r.image, r.prefilled, min(len(r.ids) - r.prefilled, self.prefill_chunk)),
              self.budget.prefill_slots(len(r.ids))) for r in prefilling],
            self.prefill_chunk, self.step_token_budget, self.max_rows,
            scoring={r.handle.id for r in prefilling if r.plp is not None}, intake=intake,
            # text prompts on the base model prefill on packed rows where the family allows
            packable={r.handle.id for r in prefilling if r.image is None and not r.slot}
            if self._executor.packs else (),
        )

    # ---------------------------------------------------------------- phase 3: decode
    def _decode(self) -> None:
        """Plan the decode or verify (`scheduler.plan_decode`, after the drafters when rows
        speculate: `drafters.speculate`), execute it, emit its tokens (one loop for both)."""
        live = self._batch.live()
        drafts, k = {}, 0
        if not any(r.processors for r in live) and any(r.drafter is not None for r in live):
            drafts, k = speculate(self._spec, self._batch, self.model.config.vocab_size,
                                  self._decided, self._emitter.fail)
            live = self._batch.live()  # a drafter may fail its row
            if not live:
                return
        plan = sched.plan_decode(
            [(r.handle.id, r.cache_len, r.grammar is not None, bool(r.processors)) for r in live],
            {r.handle.id: len(t) for r, (t, _) in drafts.items()}, k)
        res = self._executor.verify(plan, drafts) if k else self._executor.decode(plan)
        if res is not None:
            self._emitter.emit_result(res)

    def _decided(self, decide: Callable[[], Any]) -> Any:
        """A decision every rank must share (it depends on timing): rank 0's."""
        return decide() if self._ranks is None else self._ranks.decided(decide)

    # ---------------------------------------------------------------- failures
    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        self._jobs.drop(error)
        for r in pending + list(self._prefilling) + self._batch.live():
            if r.phase != "done":
                self._emitter.fail(r, error)
        self._batch.drop()
        self._prefilling.clear()
