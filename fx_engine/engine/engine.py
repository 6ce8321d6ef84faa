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
`decode_step_compiled` per step advances every active row. The policy is in specs/engine.md.

A step reads plan -> execute -> emit: `scheduler.plan_step` returns the step's plan as plain
data (prefill calls) and `scheduler.plan_growth` / `plan_maintenance` the batch's memory
upkeep; the Engine executes them on the pure steps and the decode batch (`batch.py`: rows,
KVCache, DecodeState surgery), with speculation decided by the pure cost model in
`speculation.py`; each sampled token is emitted through `output.py` (detokenizing, stops,
logprobs) to the request's handle (`handles.py`). This class is the orchestrator: the
request queue, the thread, the step, failures and trace events.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import itertools
import math
import concurrent.futures
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

import attrs
import mlx.core as mx
import numpy as np

from fx_engine.core.adapters import Adapters
from fx_engine.core.cache import KVCache, bytes_per_token, prefix_in_cache, span_bucket, state_dtype
from fx_engine.engine.kv_rows import insert_row, row_view, snapshot_row, stack_rows
from fx_engine.core.sampling import mask_words, top_logprobs
from fx_engine.core.state import DecodeState, init_state
from fx_engine.core.steps import (decode_step_compiled, prefill_step_compiled, sample_step_compiled, score_step_compiled, verify_step_compiled)
from fx_engine.core.tree import tree_leaves, tree_replace
from fx_engine.engine import scheduler as sched
from fx_engine.engine.batch import DecodeBatch, insert_state_row
from fx_engine.engine.constraints import RowGrammar, grammar_tokenizer
from fx_engine.engine.jobs import JobQueue, run_steps
from fx_engine.engine.handles import RequestHandle
from fx_engine.engine.output import TokenOutput
from fx_engine.engine.prefix_cache import DiskTier, PrefixStore
from fx_engine.engine.request import MAX_DRAFT_TOKENS, TextDelta, Usage, apply_processors, parse_request
from fx_engine.engine.request import xtc_special_tokens as _xtc_special
from fx_engine.engine.speculation import DraftState, SpeculationPolicy
from fx_engine.runtime.distributed import broadcast, busy, gathered, timeout_seconds

__all__ = [
    "Engine", "RequestHandle", "QueueFull", "EngineClosed", "EngineForked", "LogitsProcessorError",
    "insert_row", "insert_state_row",
]

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


class LogitsProcessorError(RuntimeError):
    """A request's logits processor raised something that is not an Exception
    (KeyboardInterrupt, SystemExit) on the engine's thread, or returned NaN logits: that
    request fails with this error; its neighbours go on."""


def _run_processors(processors: Sequence[Callable[..., Any]], tokens: Sequence[int],
                    logits: mx.array) -> mx.array:
    """A row's logits processors applied and evaluated (user code: its failures are this
    row's). A KeyboardInterrupt or SystemExit raised on the engine's own thread is the
    processor's (signals reach only the main thread), so it becomes this request's
    LogitsProcessorError instead of failing every request; on the main thread (an engine
    stepped without start()) it may be a real Ctrl-C and propagates. NaN logits would
    sample EOS until max_tokens: an error naming the processors instead (checked on the
    host, one reduction per row that has processors)."""
    try:
        out = apply_processors(processors, tokens, logits)
        nan = bool(mx.any(mx.isnan(out)).item())
    except Exception:  # an ordinary failure: the caller fails this row with it
        raise
    except BaseException as e:
        if threading.current_thread() is threading.main_thread():
            raise
        raise LogitsProcessorError(f"logits_processors raised {e!r}: this request failed "
                                   "(other requests go on)") from e
    if nan:
        raise LogitsProcessorError("logits_processors returned NaN logits")
    return out


class RankMismatch(BaseException):
    """A tensor- or pipeline-parallel rank cannot do what rank 0 does in this step (not an
    Exception: no per-request handler may swallow it; the engine stops)."""


_SPMD_SEEDS = itertools.count()


def _spmd_seed() -> int:
    """The default seed of a request on a sharded model without lockstep: every rank runs
    the same program, so the n-th request gets the same seed on every rank (a random one
    would make the ranks sample different tokens)."""
    digest = hashlib.blake2b(f"fx-engine-spmd-{next(_SPMD_SEEDS)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@attrs.frozen
class _DraftRef:
    """A lockstep request's draft model as the other ranks get it: its place in
    `Engine(drafts=...)`, which every rank fills alike (the same program) with its own copy
    (a sharded model's self-draft is this rank's shard, with a per-rank fingerprint),
    never the weights."""

    index: int


def _tp_event(ids: list[int], kw: dict[str, Any], req: "_Request") -> tuple[list[int], dict[str, Any]]:
    """What the other ranks of a lockstep engine need to make the same request: the prompt's
    token ids and the arguments, with the seed rank 0 drew (plain data: pickled)."""
    import pickle

    kw = {k: v for k, v in kw.items() if k != "chat"}
    kw["seed"] = req.cfg.seed
    try:
        pickle.dumps(kw)
    except Exception as e:
        bad = [k for k, v in kw.items() if not _picklable(v)]
        raise ValueError(f"{', '.join(bad) or 'arguments'}: with tensor parallelism a request's arguments "
                         f"must be plain data sent to every rank ({type(e).__name__})") from None
    return list(ids), kw


def _picklable(v: Any) -> bool:
    import pickle

    try:
        pickle.dumps(v)
        return True
    except Exception:
        return False


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------


class _Request:
    """Engine-side per-request state (dropped when the request finishes). Its output so far
    is `out` (output.TokenOutput; `generated` is `out.generated`), its speculation state
    `spec` (speculation.DraftState)."""

    __slots__ = (
        "handle", "ids", "cfg", "max_tokens", "out", "generated", "want_logprobs", "need",
        "prefilled", "pcache", "row", "cache_len", "phase", "t_admit", "t_first", "row_state",
        "processors", "drafter", "row_drafter", "spec", "cached", "salt", "grammar", "plp",
        "slot", "tp_event", "tp_cancel",
    )

    def __init__(self, handle, ids, cfg, max_tokens, out, processors=(), drafter=None,
                 k_max=0, salt=None, grammar=None):
        self.handle = handle
        self.grammar = grammar  # constraints.RowGrammar: the output's grammar state, or None
        self.plp: int | None = None  # prompt_logprobs: top-N per prompt token (None: off)
        self.salt = salt  # the prefix-cache scope (cache_salt)
        self.ids = ids
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.out = out
        self.generated: list[int] = out.generated
        self.want_logprobs = out.want_logprobs
        self.need = len(ids) + max_tokens
        self.prefilled = 0
        self.pcache: KVCache | None = None
        self.row: int | None = None
        self.cache_len = 0
        self.phase = "queued"
        self.t_admit = 0.0
        self.t_first = 0.0
        self.row_state: DecodeState | None = None
        self.processors = processors
        # speculative decoding: the request's drafter, its per-row state, the adaptive draft
        # length and counters
        self.drafter = drafter
        self.row_drafter = None
        self.spec = DraftState(k_max)
        self.cached = 0  # prompt tokens restored from the prefix cache
        self.slot = 0  # the row's adapter slot in the model's adapter bank (0: the base)
        # lockstep tensor parallelism: (prompt ids, arguments) not yet sent to the other
        # ranks (None: sent, or not lockstep); whether the ranks agreed to cancel it
        self.tp_event: Any = None
        self.tp_cancel = False


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
        lockstep: bool = False,
        drafts: Sequence[Any] = (),
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
        # Lockstep: the draft models every rank loaded, in the same order; a request's draft
        # goes to the other ranks as its place in this list (_DraftRef), each using its own.
        for d in drafts:
            if not hasattr(d, "fingerprint") or not hasattr(d, "params"):
                raise ValueError(f"drafts: expected fx_engine Models, got {type(d).__name__}")
        self._drafts: list[Any] = list(drafts)
        # Reuse of shared prompt prefixes (0 bytes: off). See engine/prefix_cache.py.
        self.prefix_cache = None
        c = model.config
        self._c = c
        self._dtype = model.cache_dtype  # the KV cache's element type
        # Ring entries need headroom for the longest step: a prefill chunk or a verify.
        self._headroom = max(sched.normalize_chunk(prefill_chunk), MAX_DRAFT_TOKENS)
        self.cache_layout = model.cache_layout(self._headroom)
        if model.ranks > 1 and prefix_cache_dir is not None:
            # each rank keeps its own share of every entry, in its own subdirectory (its own
            # byte budget evicts only its files); what a request restores is the length every
            # rank holds (`_restore_prefix`)
            prefix_cache_dir = str(Path(prefix_cache_dir) / f"rank{mx.distributed.init().rank()}of{model.ranks}")
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
        # Recurrent layers' states: a fixed size per row (not per token), reserved out of the
        # budget for max_rows rows, in token slots of the per-token entries.
        self.state_bytes_per_row = sum(
            math.prod(shape) * state_dtype(s, i, self._dtype).size
            for s in self.cache_layout for i, shape in enumerate(s.state))
        states = max_rows * self.state_bytes_per_row
        if kv_budget_bytes is not None:
            if kv_budget_bytes <= 0:
                raise ValueError(f"kv_budget_bytes must be > 0, got {kv_budget_bytes!r}")
            if kv_budget_bytes <= states:
                raise ValueError(f"kv_budget_bytes ({kv_budget_bytes}) cannot hold the recurrent "
                                 f"states of max_rows={max_rows} rows ({states} bytes)")
            # no per-token entries (a purely recurrent model): only the states count
            kv_budget_tokens = (int((kv_budget_bytes - states) // self.bytes_per_token)
                                if self.bytes_per_token else None)
        elif kv_budget_tokens is not None and states and self.bytes_per_token:
            reserved = -(-states // int(self.bytes_per_token))
            if kv_budget_tokens <= reserved:
                raise ValueError(
                    f"the KV budget ({kv_budget_tokens} token slots) cannot hold the recurrent "
                    f"states of max_rows={max_rows} rows ({reserved} slots' worth: "
                    f"{self.state_bytes_per_row} bytes per row)")
            kv_budget_tokens -= reserved
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

        self._pid = os.getpid()  # the only process that may use it (see _check_process)
        self._lock = threading.Condition()
        self._pending: collections.deque[_Request] = collections.deque()  # under _lock
        self._jobs = JobQueue(self._lock)  # work beside the rows (embeddings), one call a step
        self._closing = False
        self._abort = False
        # Tensor or pipeline parallelism (model.ranks > 1): every rank's engine must run the
        # same steps on the same rows. Decisions that depend on timing (speculation) are
        # rank 0's, sent to the others at the point they are made (`_decided`). lockstep:
        # requests reach rank 0 only (a server); each step starts by sending the other
        # ranks what rank 0 queued and cancelled since the last one (`_sync_events`), and
        # the other ranks run `follow()`. Without lockstep every rank submits the same
        # requests itself before stepping (SPMD scripts, `fx-engine generate`).
        self._tp_rank: int | None = None
        if model.ranks > 1:
            self._tp_rank = mx.distributed.init().rank()
        elif lockstep:
            raise ValueError("lockstep: the model is not tensor-parallel (load it with tensor_parallel=N "
                             "or pipeline_parallel=N)")
        self._lockstep = lockstep
        self._synced_abort = False  # lockstep: the abort flag rank 0 sent with this step
        if self._tp_rank is not None:
            # Every rank must make the same admission and prefix-cache decisions, but a
            # rank's KV bytes per token depend on its share (SmolLM2's 3 KV heads: 2 + 1;
            # pipeline stages of unequal layers): the smallest rank's token budget for
            # everyone, and every entry's cost measured in the largest share's bytes (this
            # rank's bytes times the largest bytes per token over its own), so no rank
            # holds more than its budgets.
            ranks = gathered([-1 if self.kv_budget_tokens is None else int(self.kv_budget_tokens),
                              int(self.bytes_per_token)])
            budgets = [b for b, _ in ranks if b >= 0]  # (-1: no per-token entries, no bound)
            self.kv_budget_tokens = min(budgets) if budgets else None
            if self.prefix_cache is not None:
                self.prefix_cache.cost_scale = (max(1, max(n for _, n in ranks)), max(1, int(self.bytes_per_token)))
            model.adapters.freeze("a tensor- or pipeline-parallel engine is running: load adapters "
                                  "on every rank before creating it")
        self._announced = 0  # submissions sent to the other ranks (rank 0, lockstep)
        self._stopped = False  # follow(): rank 0 has closed its engine
        # lockstep rank 0 steps at least this often (an empty step when idle), so the other
        # ranks' watchdog tells a dead rank 0 from an idle one
        self._heartbeat = timeout_seconds() / 4 if lockstep and self._tp_rank == 0 else None
        self._thread: threading.Thread | None = None
        self._step_lock = threading.Lock()
        self._next_id = 0
        self.steps = 0
        # The speculation cost model: measured step costs per (row bucket, K), K chosen
        # per step from them (engine/speculation.py).
        self._spec = SpeculationPolicy()

        # engine-thread state
        self._prefilling: list[_Request] = []
        self._prefill_calls = 0  # prefill_step calls so far (the `call` of prefill events)
        # the decode batch: its rows (requests), KVCache and DecodeState (engine/batch.py)
        # (its trace callback holds the engine weakly: no reference cycle, so an engine
        # nobody holds is freed at once with its caches, not at the next garbage collection)
        self._batch = DecodeBatch(model, self._headroom, c.vocab_size, self._special, max_rows,
                                  self.kv_budget_tokens, _weak_method(self._trace))  # (rank 0's when sharded)

    @property
    def _cache(self) -> KVCache | None:
        """The decode batch's cache (None: no batch)."""
        return self._batch.cache

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
        if self._lockstep and self._tp_rank != 0:
            raise RuntimeError(f"rank {self._tp_rank} follows rank 0 (lockstep): submit requests on "
                               "rank 0; call engine.follow() here")
        made = []
        for kw in kwargs_list:
            made.append(self._make_request(prompt if not made else made[0][1], kw))
        if self._lockstep:
            for (req, ids), kw in zip(made, kwargs_list):
                req.tp_event = _tp_event(ids, self._draft_ref(kw), req)
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
        if self._tp_rank is not None:  # work outside the steps would run on one rank only
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
            "kv_bytes_per_token_float": self._float_bytes_per_token,
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.stats(),
            "steps": self.steps,
        }

    # ---------------------------------------------------------------- submission
    def _draft_ref(self, kw: dict[str, Any]) -> dict[str, Any]:
        """A lockstep request's arguments with its draft model as a _DraftRef (every rank
        must have registered the same draft: Engine(drafts=...))."""
        d = kw.get("draft_model")
        if d is None or not hasattr(d, "fingerprint") or not hasattr(d, "params"):
            return kw
        at = [i for i, x in enumerate(self._drafts) if x is d or x.fingerprint == d.fingerprint]
        if not at:
            raise ValueError("draft_model: with lockstep tensor / pipeline parallelism every rank must "
                             "load the draft model and pass it as Engine(drafts=[...]) "
                             "(fx-engine serve --draft-model does)")
        return {**kw, "draft_model": _DraftRef(at[0])}

    def _make_request(self, prompt: Any, kw: dict[str, Any]) -> tuple[_Request, list[int]]:
        if isinstance(kw.get("draft_model"), _DraftRef):  # a follower: its own copy of rank 0's draft
            i = kw["draft_model"].index
            if i >= len(self._drafts):
                raise RankMismatch(f"rank {self._tp_rank}: rank 0's request uses draft model {i} of its "
                                   f"Engine(drafts=...); this rank has {len(self._drafts)}")
            kw = {**kw, "draft_model": self._drafts[i]}
        if self._tp_rank is not None and not self._lockstep and kw.get("seed") is None:
            kw = {**kw, "seed": _spmd_seed()}
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
        out = TokenOutput(self.model.tokenizer, self.eos, r.stops, max_tokens, r.n_top > 0,
                          r.sampling.logprobs)
        grammar = None
        if r.constraint is not None:
            grammar = RowGrammar(r.constraint, grammar_tokenizer(
                self.model.tokenizer, self._c.vocab_size, self.eos))
        salt = r.cache_salt
        if r.adapter is not None:
            # the prefix-cache scope of an adapter's rows: its contents' fingerprint (never
            # shared with the base or another adapter; stable across restarts for the disk tier)
            salt = f"\x00adapter:{r.adapter.fingerprint}\x00{salt or ''}"
        req = _Request(None, ids, r.sampling, max_tokens, out, r.processors, r.drafter,
                       r.num_draft_tokens, salt, grammar)
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
                    while not (self._pending or self._prefilling or self._live_rows()
                               or self._closing or self._jobs):
                        if not self._lock.wait(self._heartbeat):
                            break  # lockstep rank 0, idle: an empty step tells the others it lives
                    if self._closing and not (self._abort or self._pending or self._prefilling
                                              or self._live_rows() or self._jobs):
                        return
                try:
                    self.step()
                except BaseException as e:  # a step-level failure: fail every request, go on
                    self._fail_all(e)
                    if self._tp_rank is not None:
                        # the other ranks may not have failed alike: their steps no longer
                        # match this rank's, so this engine stops (they stop at its next
                        # sync, or their watchdog ends them)
                        with self._lock:
                            self._closing = self._abort = True
                        return
                if self._abort and not self.has_work():
                    return
        finally:
            self._stop_followers()
            self._end_thread()

    def _stop_followers(self) -> None:
        if self._lockstep and self._tp_rank == 0 and not self._stopped:
            self._stopped = True
            with self._step_lock, busy(True):
                self._sync_events(stop=True)

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
        return self._batch.any_live()

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
            if self._lockstep:
                # the other ranks wait here for rank 0, which steps at least every heartbeat;
                # rank 0 waits for them: watched on every rank
                with busy(True):
                    self._sync_events()
                if self._stopped:
                    return False
            with busy(self._tp_rank is not None):  # a lost rank: an error, not a hang
                self._step()
        return self.has_work()

    def follow(self) -> None:
        """Tensor-parallel ranks other than 0 of a lockstep engine: run every step rank 0
        runs, on the requests rank 0 sends, until rank 0 closes its engine."""
        if not self._lockstep or self._tp_rank == 0:
            raise RuntimeError("follow(): only for ranks > 0 of a lockstep tensor-parallel engine")
        while not self._stopped:
            self.step()
        self._fail_all(EngineClosed("rank 0 closed the engine"))

    def _sync_events(self, stop: bool = False) -> None:
        """Lockstep: rank 0 sends what it queued and cancelled since the last step (stop:
        that it closed); the other ranks apply the same, so every rank admits and retires
        the same requests at the same step."""
        if self._tp_rank == 0:
            with self._lock:
                new = [r for r in self._pending if r.tp_event is not None]
                known = list(self._pending) + list(self._prefilling) + self._batch.live()
                cancel = [r for r in known if r.handle._cancel and not r.tp_cancel]
                record = {"submit": [r.tp_event for r in new], "cancel": [r.handle.id for r in cancel],
                          "abort": self._abort, "stop": stop}
                self._synced_abort = record["abort"]
                for r in new:
                    r.tp_event = None
            broadcast(record, 0)
            for r in cancel:
                r.tp_cancel = True
            return
        record = broadcast(None, self._tp_rank)
        if record["stop"]:
            self._stopped = True
            return
        for ids, kw in record["submit"]:
            req, ids = self._make_request(ids, kw)
            with self._lock:
                req.handle = RequestHandle(self, self._next_id, tuple(ids))
                self._next_id += 1
                self._pending.append(req)
        ids = set(record["cancel"])
        for r in list(self._pending) + list(self._prefilling) + self._batch.live():
            if r.handle.id in ids:
                r.tp_cancel = r.handle._cancel = True
        self._abort = self._synced_abort = self._abort or record["abort"]

    def _cancelled(self, r: _Request) -> bool:
        """Whether to cancel this request now (lockstep: when the ranks agreed to)."""
        return r.tp_cancel if self._lockstep else r.handle._cancel

    def _decided(self, decide: Callable[[], Any]) -> Any:
        """A decision every rank must share (it depends on timing): rank 0's."""
        if self._tp_rank is None:
            return decide()
        return broadcast(decide() if self._tp_rank == 0 else None, self._tp_rank)

    def _step(self) -> None:
        """Plan -> execute -> emit: retire cancelled requests and admit; plan the step
        (`scheduler.plan_step`: plain data); execute its prefill calls, insert the requests
        they finished, run one decode/verify step over the batch (tokens are emitted as they
        are read back, `_on_token`); then the batch's upkeep (`scheduler.plan_maintenance`)."""
        t0 = time.perf_counter()
        self._jobs.run_one(self._trace)  # one bounded call of long work (embeddings)
        self.steps += 1
        if self._synced_abort if self._lockstep else self._abort:  # lockstep: what every rank got
            self._cancel_everything()
        self._retire_cancelled()
        self._admit()

        batch, prefilling = self._batch, self._prefilling
        plan = sched.plan_step(
            sum(r is not None for r in batch.rows),
            [(i, len(r.ids) - r.prefilled, self._prefill_slots(r)) for i, r in enumerate(prefilling)],
            self.prefill_chunk, self.step_token_budget, self.max_rows,
        )
        # resolved before any call runs: a call can retire requests (errors, a first token
        # that finishes), which shifts the indices
        calls = [(size, [(prefilling[i], n) for i, n in members]) for size, members in plan.prefill]
        finished_prefill: list[_Request] = []
        for size, pieces in calls:
            finished_prefill += self._prefill_call(size, pieces)
        for req in finished_prefill:
            if req.phase == "prefill":  # not finished by its first token
                self._prefilling.remove(req)
                self._insert(req)

        if batch.any_live():
            self._decode()
        batch.maintain(bool(self._prefilling))
        self._trace("step", seconds=time.perf_counter() - t0)

    # ---------------------------------------------------------------- admission
    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                req = self._pending[0]
                if req.tp_event is not None:  # lockstep: not yet sent to the other ranks
                    return
                needs = [r.need for r in self._prefilling] + [r.need for r in self._batch.live()]
                prefilling = [self._prefill_slots(r) for r in self._prefilling]
                if not sched.can_admit(needs, req.need, self.max_rows, self.kv_budget_tokens,
                                       prefilling, self._prefill_slots(req)):
                    return
                self._pending.popleft()
            req.phase = "prefill"
            req.t_admit = time.perf_counter()
            req.handle.timings["admitted"] = req.t_admit
            req.out.detok = self.model.tokenizer.detokenizer()
            self._prefilling.append(req)
            self._restore_prefix(req)
            req.handle.cached_tokens = req.cached  # known now, long before the usage at the end
            self._trace("admit", request=req.handle.id, prompt_tokens=len(req.ids),
                        max_tokens=req.max_tokens, cached_tokens=req.cached)

    # ---------------------------------------------------------------- prefix cache
    def _restore_prefix(self, req: _Request) -> None:
        """Start the request's prefill cache from the longest cached prefix of its prompt
        (fx_engine/engine/prefix_cache.py); only the rest is prefilled."""
        if self.prefix_cache is None or req.plp is not None:  # scoring needs every position
            return
        entry, m = None, 0
        try:
            entry, m = self.prefix_cache.lookup(req.ids, req.salt)
        except Exception as e:
            self._trace("prefix_error", request=req.handle.id, error=repr(e))
        if self._tp_rank is not None:
            # every rank restores the same length: the longest every rank holds (their
            # stores agree while their memory budgets do, but disk files are each rank's own)
            agree = lambda v: int(mx.distributed.all_min(mx.array([v], mx.int32)).item())  # noqa: E731
            want = agree(m if entry is not None else 0)
            # a shorter prefix than this rank's match must still be restorable here (ring
            # and recurrent layers keep only some lengths): if any rank cannot, none does
            if want and not agree(int(entry is not None and (
                    want == m or prefix_in_cache(entry.cache.layout, len(entry.tokens), want)))):
                want = 0
            entry, m = (entry, want) if want else (None, 0)
        try:
            if entry is None:
                return
            cache = self.model.new_cache(1, self._prefill_slots(req), headroom=self._headroom)
            req.pcache = self.prefix_cache.restore(entry, cache, m)
            req.prefilled = req.cached = m
        except Exception as e:  # a broken entry must never break the request: go cold
            if self._tp_rank is not None:  # (alone: the other ranks restored: out of step)
                raise RankMismatch(f"rank {self._tp_rank}: restoring the {m} prompt tokens every rank "
                                   f"agreed on failed ({e!r})") from e
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
        done = []
        scoring = [(r, n) for r, n in ok if r.plp is not None]
        if scoring:  # prompt logprobs: logits at every position, one row per call
            ok = [(r, n) for r, n in ok if r.plp is None]
            for r, n in scoring:
                done += self._prefill_rows(sched.chunk_bucket(n), [(r, n)], score=True)
        if len(ok) != len(pieces):  # keep power-of-two row counts (bounded compile shapes)
            at = 0
            for rows in sched.pow2_splits(len(ok)):
                part = ok[at : at + rows]
                at += rows
                done += self._prefill_rows(max(sched.chunk_bucket(n) for _, n in part), part)
            return done
        return self._prefill_rows(size, ok)

    def _prefill_rows(self, size: int, pieces: list[tuple[_Request, int]],
                      score: bool = False) -> list[_Request]:
        """One prefill_step (score=True: score_step, and each row's prompt logprobs from
        its logits at every position) over `pieces`; see `_prefill_call`."""
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
            step = score_step_compiled if score else prefill_step_compiled
            logits, cache = step(
                self.params, cache, mx.array(tokens, mx.int32),
                mx.array([n for _, n in pieces], mx.int32),
                span=span_bucket(max(starts) + size, cap), **self._adapters(reqs),
            )
            if score:
                all_logits = logits
                last = mx.array([n - 1 for _, n in pieces], mx.int32)
                logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
            host = time.perf_counter() - t0  # graph build + call; the rest is evaluation
            mx.eval(logits, *tree_leaves(cache))
            if score:
                for i, ((r, n), s) in enumerate(zip(pieces, starts)):
                    self._prompt_logprobs(r, all_logits[i, :n], s, n)
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
        if req.plp is not None:
            req.handle.prompt_logprobs = tuple(req.out.prompt_lps)
        if req.max_tokens == 0:  # scoring only: the prompt is prefilled, nothing sampled
            self._snapshot(req, req.ids, req.pcache, 0)
            req.t_first = time.perf_counter()
            req.cache_len = len(req.ids)
            self._complete(req, "length")
            return
        if req.processors:
            logits = _run_processors(req.processors, req.ids, logits)
        mask = self._masks([req], fail=False)  # a grammar error fails this prefill row
        row_state = (sample_step_compiled(row_state, logits) if mask is None
                     else sample_step_compiled(row_state, logits, mask))
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
            lp = req.out.logprob(token, float(row_state.logprob[0].item()),
                                 row_state.top_ids[0].tolist(), row_state.top_logprobs[0].tolist())
        req.row_state = row_state
        self._on_token(req, token, lp)

    def _prompt_logprobs(self, req: _Request, logits: mx.array, start: int, n: int) -> None:
        """Append the records of prompt tokens start+1 .. start+n (those this chunk's
        positions predict; the last prompt position predicts the first generated token)."""
        targets = req.ids[start + 1 : start + n + 1]
        if not targets:
            return
        lg = logits[: len(targets)].astype(mx.float32)
        lsm = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lsm, mx.array(targets, mx.int32)[:, None], axis=-1)[:, 0]
        top_ids, top_vals = top_logprobs(lsm, req.plp)
        chosen, top_ids, top_vals = chosen.tolist(), top_ids.tolist(), top_vals.tolist()
        rec = req.out.prompt_logprob
        req.out.prompt_lps.extend(rec(t, c, i, v, req.plp)
                                  for t, c, i, v in zip(targets, chosen, top_ids, top_vals))

    def _prefill_slots(self, req: _Request) -> int:
        return sched.prefill_slots(len(req.ids), self.prefill_chunk)

    # ---------------------------------------------------------------- insertion
    def _insert(self, req: _Request) -> None:
        row_state, req.row_state = req.row_state, None
        batch = self._batch
        try:
            row = batch.insert(req, req.pcache, row_state, req.cache_len)
            req.pcache = None
            req.phase = "decode"
        except Exception as e:
            self._fail(req, e)
            return
        self._trace("insert", request=req.handle.id, row=row, rows=len(batch.rows),
                    capacity=batch.cache.capacity)

    # ---------------------------------------------------------------- decode
    def _decode(self) -> None:
        batch = self._batch
        live = batch.live()
        if not any(r.processors for r in live) and any(r.drafter is not None for r in live):
            # Ask drafters only when speculating is expected to pay (their work is not free),
            # then decide again with the drafts actually proposed.
            by_id = {r.handle.id: r for r in live}
            plan = {by_id[i]: k for i, k in self._decided(
                lambda: {r.handle.id: k for r, k in self._plan_drafts(live).items()}).items()}
            if plan:
                t0 = time.perf_counter()
                drafts = self._propose(plan)
                self._spec.observe_drafting(time.perf_counter() - t0)
                live = batch.live()  # a drafter may fail its row
                k = self._decided(lambda: self._spec.choose_k(
                    len(batch.rows), [(r.spec.alpha, len(t)) for r, (t, _) in drafts.items()],
                    len(live)) if drafts else 0)
                if k:
                    return self._decode_speculative(
                        {r: (t[:k], None if p is None else p[:k]) for r, (t, p) in drafts.items()}, k)
            if not live:
                return
        max_len = max(r.cache_len for r in live)
        batch.ensure_capacity(max_len + 1)  # may compact: row indices are read after it
        mask = self._masks(batch.rows)  # before the rows are read: it may fail a request
        rows = batch.rows
        if not any(r is not None for r in rows):
            return
        # `full` is cleared each step: after it, it names the rows that had no room
        state = tree_replace(batch.state, active=mx.array([r is not None for r in rows]),
                             full=mx.zeros((len(rows),), mx.bool_))
        batch.state = None
        span = span_bucket(max_len + 1, batch.cache.capacity)
        t0 = time.perf_counter()
        traces = decode_step_compiled.traces
        failed: dict[int, BaseException] = {}
        if any(r.processors for r in live):
            state, cache = self._decode_with_processors(state, span, failed, mask)
        elif mask is None:  # the fast path: forward and sampling in one compiled step
            state, cache = decode_step_compiled(self.params, batch.cache, state, span=span,
                                                **self._adapters(rows))
        else:  # constrained rows: the same step with their allowed-token masks
            state, cache = decode_step_compiled(self.params, batch.cache, state, span=span,
                                                mask=mask, **self._adapters(rows))
        host = time.perf_counter() - t0
        batch.cache = None
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
        batch.state, batch.cache = state, cache
        toks, full = state.tokens.tolist(), state.full.tolist()
        lps = top_ids = top_vals = None
        if any(r.want_logprobs for r in live):
            lps, top_ids, top_vals = state.logprob.tolist(), state.top_ids.tolist(), state.top_logprobs.tolist()
        seconds = time.perf_counter() - t0
        if decode_step_compiled.traces == traces and not failed:
            self._spec.observe(len(rows), 0, seconds)
        self._trace("decode", batch=len(live), rows=len(rows), capacity=cache.capacity,
                    span=span, requests=[r.handle.id for r in live], seconds=seconds,
                    host_seconds=host)
        # emit: each row's token through its output (stops, detokenizing, logprobs)
        for row, req in enumerate(rows):
            if req is None:
                continue
            if full[row]:  # no room for its token (the batch could not grow): stopped
                self._complete(req, "length")
                continue
            req.cache_len += 1
            if row in failed:  # its logits processor raised: this request only
                self._fail(req, failed[row])
                continue
            try:
                tok = toks[row]
                lp = None
                if req.want_logprobs:
                    lp = req.out.logprob(tok, lps[row], top_ids[row], top_vals[row])
                self._on_token(req, tok, lp)
            except Exception as e:
                self._fail(req, e)

    # ---------------------------------------------------------------- speculation
    def _plan_drafts(self, live: list[_Request]) -> dict[_Request, int]:
        """How many tokens to ask each speculating row for this step ({}: do not draft):
        the policy's `plan_drafts` over the rows that may speculate (a drafter, no XTC)."""
        candidates = {r: (r.spec, r.max_tokens - len(r.generated)) for r in live
                      if r.drafter is not None and not r.cfg.xtc_probability > 0}
        return self._spec.plan_drafts(len(self._batch.rows), candidates, len(live))

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
        batch = self._batch
        live = batch.live()
        # Room for each row's own drafts (padding goes to the sink); may compact the rows,
        # so row indices are read after it.
        needed = max(r.cache_len + len(drafts.get(r, ((), None))[0]) + 1 for r in live)
        batch.ensure_capacity(needed)
        # Constrained rows: the mask at every verified position, and only the drafts their
        # grammar allows (may fail a request, so before the rows are read).
        masks = self._draft_masks(batch.rows, drafts, k)
        rows_ = batch.rows
        if not any(r is not None for r in rows_):
            return
        b = len(rows_)
        arr = [[0] * k for _ in range(b)]
        n = [0] * b
        for req, (toks, _) in drafts.items():
            if req.row is None:
                continue
            arr[req.row][: len(toks)] = toks
            n[req.row] = len(toks)
        probs = None
        if any(p is not None for _, p in drafts.values()):
            v = self._c.vocab_size
            rows = []
            for row in range(b):
                req = rows_[row]
                toks, p = drafts.get(req, ((), None)) if req is not None else ((), None)
                if p is None:  # deterministic drafts: a point mass on each token
                    p = mx.zeros((len(toks), v)) if not toks else (
                        mx.arange(v)[None, :] == mx.array(toks)[:, None]).astype(mx.float32)
                rows.append(mx.pad(p.astype(mx.float32), [(0, k - p.shape[0]), (0, 0)]))
            probs = mx.stack(rows)
        state = tree_replace(batch.state, active=mx.array([r is not None for r in rows_]),
                             full=mx.zeros((len(rows_),), mx.bool_))
        batch.state = None
        max_len = max(r.cache_len for r in live)
        span = span_bucket(max_len + k + 1, batch.cache.capacity)
        t0 = time.perf_counter()
        traces = verify_step_compiled.traces
        extra = {} if masks is None else {"mask": masks}
        extra.update(self._adapters(rows_))
        state, cache, res = verify_step_compiled(
            self.params, batch.cache, state, mx.array(arr, mx.int32), mx.array(n, mx.int32),
            probs, span=span, **extra)
        host = time.perf_counter() - t0
        batch.cache = None
        mx.eval(*tree_leaves(state), *tree_leaves(cache), *tree_leaves(res))
        batch.state, batch.cache = state, cache
        toks, counts, acc = res.tokens.tolist(), res.count.tolist(), res.accepted.tolist()
        full = state.full.tolist()
        if any(r.want_logprobs for r in live):
            lps, top_ids, top_vals = res.logprobs.tolist(), res.top_ids.tolist(), res.top_logprobs.tolist()
        seconds = time.perf_counter() - t0
        if verify_step_compiled.traces == traces:
            self._spec.observe(b, k, seconds)
        self._trace("verify", batch=len(live), rows=b, k=k, drafted=sum(n), accepted=sum(acc),
                    capacity=cache.capacity, span=span, requests=[r.handle.id for r in live],
                    seconds=seconds, host_seconds=host)
        # emit: each row's accepted drafts and correction/bonus token, in order
        for row, req in enumerate(rows_):
            if req is None:
                continue
            if full[row]:  # no room for its token (the batch could not grow): stopped
                self._complete(req, "length")
                continue
            req.cache_len += counts[row]
            if n[row]:
                req.spec.adapt(n[row], acc[row])
            try:
                for i in range(counts[row]):
                    lp = None
                    if req.want_logprobs:
                        lp = req.out.logprob(toks[row][i], lps[row][i], top_ids[row][i], top_vals[row][i])
                    if self._on_token(req, toks[row][i], lp):
                        break
            except Exception as e:
                self._fail(req, e)

    def _decode_with_processors(
        self, state: DecodeState, span: int, failed: dict[int, BaseException],
        mask: mx.array | None = None,
    ) -> tuple[DecodeState, KVCache]:
        """decode_step split in two around the rows' logits processors: the forward (a
        one-token prefill_step), the processors eagerly per row, then sample_step. A row
        whose processor raises keeps its unprocessed logits and is failed by the caller;
        the other rows are unaffected."""
        batch = self._batch
        logits, cache = prefill_step_compiled(
            self.params, batch.cache, state.tokens[:, None], state.active.astype(mx.int32),
            span=span, **self._adapters(batch.rows),
        )
        batch.cache = None
        rows = [logits[i : i + 1] for i in range(logits.shape[0])]
        for i, req in enumerate(batch.rows):
            if req is None or not req.processors:
                continue
            try:
                rows[i] = _run_processors(req.processors, req.ids + req.generated, rows[i])
            except Exception as e:
                failed[i] = e
        logits = mx.concatenate(rows, axis=0)
        if mask is None:
            return sample_step_compiled(state, logits), cache
        return sample_step_compiled(state, logits, mask), cache

    # ---------------------------------------------------------------- adapters
    def _adapters(self, rows: Sequence[_Request | None]) -> dict[str, Adapters]:
        """The `adapters` step argument for these rows ({} when every row is on the base
        model: the base step, with no low-rank work). Empty rows use slot 0."""
        slots = [0 if r is None else r.slot for r in rows]
        if not any(slots):
            return {}
        return {"adapters": Adapters(self.model.adapters.bank(), mx.array(slots, mx.int32))}

    # ---------------------------------------------------------------- grammars
    def _masks(self, rows: Sequence[_Request | None], fail: bool = True) -> mx.array | None:
        """The allowed-token bitmask of every row (constrained rows from their grammar, the
        others all ones), or None when no row is constrained. A row whose grammar fails is
        failed (its request only) and left all ones (then inactive); fail=False raises."""
        if not any(r is not None and r.grammar is not None for r in rows):
            return None
        m = np.full((len(rows), mask_words(self._c.vocab_size)), -1, np.int32)
        for i, r in enumerate(rows):
            if r is not None and r.grammar is not None:
                try:
                    r.grammar.fill(m[i])
                except Exception as e:
                    if not fail:
                        raise
                    m[i] = -1
                    self._fail(r, e)
        return mx.array(m)

    def _draft_masks(self, rows: Sequence[_Request | None], drafts: dict[_Request, Any],
                     k: int) -> mx.array | None:
        """verify_step's masks [B, K+1, W] (None: no constrained row); cuts each constrained
        row's drafts (in `drafts`) to the prefix its grammar allows."""
        if not any(r is not None and r.grammar is not None for r in rows):
            return None
        m = np.full((len(rows), k + 1, mask_words(self._c.vocab_size)), -1, np.int32)
        for i, r in enumerate(rows):
            if r is None or r.grammar is None:
                continue
            toks, probs = drafts.get(r, ((), None))
            try:
                ok = r.grammar.draft_masks(toks, m[i])
            except Exception as e:
                m[i] = -1
                drafts.pop(r, None)
                self._fail(r, e)
                continue
            if ok < len(toks):
                if ok:
                    drafts[r] = (toks[:ok], None if probs is None else probs[:ok])
                else:
                    drafts.pop(r, None)
        return mx.array(m)

    # ---------------------------------------------------------------- emit
    def _on_token(self, req: _Request, token: int, lp: Any) -> bool:
        """One sampled token through the request's output (output.TokenOutput: stops,
        detokenization, logprobs), its event to the handle. Returns True if finished."""
        if self.fault_hook is not None:
            self.fault_hook("token", req.handle)
        if req.grammar is not None:
            req.grammar.consume(token)
        delta, reason = req.out.add(token, lp)
        if delta is not None:
            req.handle._emit(delta)
        if reason is not None:
            self._complete(req, reason)
            return True
        return False

    def _complete(self, req: _Request, reason: str) -> None:
        batch = self._batch
        if req.row is not None and batch.cache is not None and batch.rows[req.row] is req:
            # the conversation so far (prompt + generated tokens in the cache) for later turns
            self._snapshot(req, (list(req.ids) + req.generated)[: req.cache_len], batch.cache,
                           req.row)
        tail = req.out.finish(reason)
        now = time.perf_counter()
        t_first = req.t_first or now
        usage = Usage(
            prompt_tokens=len(req.ids), completion_tokens=len(req.generated),
            cached_tokens=req.cached,
            prompt_seconds=(t_first - req.t_admit) if req.t_admit else 0.0,
            generation_seconds=now - t_first,
            drafted_tokens=req.spec.drafted, accepted_tokens=req.spec.accepted,
        )
        h = req.handle
        h.timings["finished"] = now
        completion = req.out.completion(reason, usage, req.ids)
        self._release(req, reason)
        h._emit(req.out.final_delta(tail, reason, usage))
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
        rows = self._batch.rows
        if req.row is not None and rows and rows[req.row] is req:
            self._batch.release(req.row)
        req.pcache = None
        self._trace("retire", request=req.handle.id, row=req.row, reason=reason,
                    generated=len(req.generated), **fields)
        req.row = None

    def _retire_cancelled(self) -> None:
        with self._lock:
            gone = [r for r in self._pending if self._cancelled(r)]
            for r in gone:
                self._pending.remove(r)
        for r in gone:
            r.phase = "queued"
            self._complete(r, "cancelled")
        for r in list(self._prefilling) + self._batch.live():
            if self._cancelled(r) and r.phase != "done":
                self._complete(r, "cancelled")

    def _cancel_everything(self) -> None:
        self._jobs.drop(None)
        with self._lock:
            for r in self._pending:
                r.handle._cancel = r.tp_cancel = True
        for r in list(self._prefilling) + self._batch.live():
            r.handle._cancel = r.tp_cancel = True

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        self._jobs.drop(error)
        for r in pending + list(self._prefilling) + self._batch.live():
            if r.phase != "done":
                self._fail(r, error)
        self._batch.drop()
        self._prefilling = []
