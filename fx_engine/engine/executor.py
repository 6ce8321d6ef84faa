"""Execute: running a step's plan on the pure steps and the decode batch.

The scheduler decides (engine/scheduler.py: plain data); this module does what the plan
says and reads the results back, once per call:

* a prefix restore at admission (`restore_prefix`: a cached prefix's KV copied into the
  request's prefill cache);
* the prefill calls (`run_prefill`, `prefill`): each `PrefillCall` stacks its rows' 1-row prefill caches
  into one `prefill_step` (or `score_step` for prompt logprobs), splits them back as
  views, keeps chunk-boundary snapshots, and samples the first token of a row whose
  prompt it finished (a 1-row state, so the draw does not depend on the call's other rows),
  and inserts the finished requests into the decode batch (`insert`);
* the decode or verify step (`decode`, `verify`), after the plan's cache growth and grammar
  masks, returning a `StepResult` for the one emit loop (engine/emit.py).

Rows whose drafter reads the target's hidden states (`drafters.capture_of`: EAGLE-3 heads,
MTP modules) make every step over them capture those states in the same forward
(`step_capture`); the executor hands each such row's drafter the states of the positions
the step kept (`drafters.observe_captured`: a prefill's chunk, a decode's position, a
verify's accepted ones). Such a request does not restore a cached prefix (its drafter
needs every position).

Failures are contained where they happen: a prefill call's failure fails its rows, a
row's logits processor or grammar fails that row, through the emitter.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import mlx.core as mx

from fx_engine.core.adapters import Adapters
from fx_engine.core.buckets import pow2_ceil
from fx_engine.core.cache import KVCache, span_bucket
from fx_engine.core.models import packs_rows
from fx_engine.core.sampling import top_logprobs
from fx_engine.core.state import DecodeState, init_state
from fx_engine.engine.image_prompt import prefix_key, step_images, whole_images
from fx_engine.core.steps import (decode_step_compiled, prefill_step_compiled, sample_step_compiled,
                                  score_step_compiled, verify_step_compiled)
from fx_engine.core.tree import tree_leaves, tree_replace
from fx_engine.engine import scheduler as sched
from fx_engine.engine.constraints import batch_masks, verify_masks
from fx_engine.engine.drafters import capture_of, draft_inputs, observe_captured, step_capture
from fx_engine.engine.emit import Emitter, StepResult, keep_prefix
from fx_engine.engine.kv_rows import row_view, stack_rows
from fx_engine.engine.lockstep import by_key
from fx_engine.engine.request import apply_processors
from fx_engine.engine.scheduler import DecodePlan, PrefillCall

__all__ = ["Executor", "LogitsProcessorError", "run_processors"]


class LogitsProcessorError(RuntimeError):
    """A request's logits processor raised something that is not an Exception
    (KeyboardInterrupt, SystemExit) on the engine's thread, or returned NaN logits: that
    request fails with this error; its neighbours go on."""


def run_processors(processors: Sequence[Callable[..., Any]], tokens: Sequence[int],
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


class Executor:
    """Runs plans (engine-thread only). `fault_hook` (testing) is set by the engine.

    model / batch: the Model and the DecodeBatch; headroom: ring slots past a sliding
    window (the longest step); special: XTC's protected ids; budget: the KVBudget (prefill
    cache sizes); emitter: where tokens and failures go; policy: the speculation cost
    model, fed each step's measured time; ranks: lockstep.Ranks or None; trace(kind, ...).
    """

    def __init__(self, model: Any, batch: Any, headroom: int, special: list[int], budget: Any,
                 emitter: Emitter, prefix_store: Any, policy: Any, ranks: Any,
                 trace: Callable[..., None]) -> None:
        self.model = model
        self.params = model.params
        self.vocab = model.config.vocab_size
        self.batch = batch
        self.headroom = headroom
        self.special = special
        self.budget = budget
        self.emitter = emitter
        self.prefix_store = prefix_store
        self.policy = policy
        self.ranks = ranks
        self.trace = trace
        self.fault_hook: Callable[[str, Any], None] | None = None
        self.prefill_calls = 0  # prefill_step calls so far (the `call` of prefill events)
        # Steps on packed rows (core/packing.py) where the family's layers allow: prefill
        # calls of text prompts (planned by the scheduler), decode batches with free rows,
        # verify steps whose rows draft fewer than the K bucket.
        self.packs = packs_rows(self.params)

    def adapters(self, rows: Sequence[Any]) -> Adapters | None:
        """The `adapters` step argument for these rows (None when every row is on the base
        model: the step without low-rank work). Empty rows use slot 0."""
        slots = [0 if r is None else r.slot for r in rows]
        if not any(slots):
            return None
        return Adapters(self.model.adapters.bank(), mx.array(slots, mx.int32))

    def _keep(self, req: Any, tokens: Sequence[int], cache: KVCache, row: int) -> None:
        keep_prefix(self.prefix_store, self.trace, req, tokens, cache, row)

    # ---------------------------------------------------------------- admission
    def restore_prefix(self, req: Any) -> None:
        """Start the request's prefill cache from the longest cached prefix of its prompt
        (engine/prefix_cache.py); only the rest is prefilled. A sharded engine restores the
        length every rank holds. A broken entry never breaks the request: it prefills cold
        (on a sharded engine a restore the others made is a RankMismatch instead)."""
        store = self.prefix_store
        if store is None or req.plp is not None:  # scoring needs every position
            return
        if capture_of(req.drafter) is not None:  # its drafter reads every position's hidden states
            return
        entry, m = None, 0
        try:
            entry, m = store.lookup(prefix_key(req.image, req.ids), req.salt)
        except Exception as e:
            self.trace("prefix_error", request=req.handle.id, error=repr(e))
        if self.ranks is not None:
            entry, m = self.ranks.agree_prefix(entry, m)
        if entry is not None and req.image is not None and whole_images(req.image, 0, m) != m:
            entry, m = None, 0  # (a prefix ending inside an image: prefilled whole instead)
        try:
            if entry is None:
                return
            cache = self.model.new_cache(1, self.budget.prefill_slots(len(req.ids)), headroom=self.headroom)
            req.pcache = store.restore(entry, cache, m)
            req.prefilled = req.cached = m
        except Exception as e:
            if self.ranks is not None:  # (alone: the other ranks restored: out of step)
                raise self.ranks.restore_failed(m, e) from e
            req.pcache, req.prefilled, req.cached = None, 0, 0
            self.trace("prefix_error", request=req.handle.id, error=repr(e))

    # ---------------------------------------------------------------- prefill
    def run_prefill(self, plan: sched.StepPlan, prefilling: list, rank: int | None) -> None:
        """The step's prefill calls; a request whose prompt they finish joins the decode
        batch in the same step (unless its first token finished it). The requests the
        calls name are resolved before any call runs (a call can retire requests)."""
        reqs = by_key(prefilling, [k for c in plan.calls for k, _ in c.pieces], rank)
        finished: list[Any] = []
        for call in plan.calls:
            finished += self.prefill(call, [reqs[k] for k, _ in call.pieces])
        for req in finished:
            if req.phase == "prefill":  # not finished by its first token
                prefilling.remove(req)
                self.insert(req)

    def insert(self, req: Any) -> None:
        """A prefilled request joins the decode batch (its K/V and its state row)."""
        row_state, req.row_state = req.row_state, None
        batch = self.batch
        try:
            row = batch.insert(req, req.pcache, row_state, req.cache_len)
            req.pcache = None
            req.phase = "decode"
        except Exception as e:
            self.emitter.fail(req, e)
            return
        self.trace("insert", request=req.handle.id, row=row, rows=len(batch.rows),
                   capacity=batch.cache.capacity)

    def prefill(self, call: PrefillCall, reqs: Sequence[Any]) -> list[Any]:
        """One planned call (`reqs`: its pieces' requests, in order); returns the requests
        whose prompt it finished (first token sampled). A row the testing fault hook fails
        leaves the call; the rest is re-split (`scheduler.split_call`: power-of-two rows)."""
        ok = []
        for req, (_, n) in zip(reqs, call.pieces):
            try:
                if self.fault_hook is not None:
                    self.fault_hook("prefill", req.handle)
                if req.image is not None:  # a piece never cuts a Gemma 3 image (its tokens see each other)
                    n = whole_images(req.image, req.prefilled, n)
                    if n == 0:  # the budget left too little for the next image: a later step
                        continue
                ok.append((req, n))
            except Exception as e:
                self.emitter.fail(req, e)
        if len(ok) == len(call.pieces) and all(n == m for (_, n), (_, m) in zip(ok, call.pieces)):
            return self._prefill_rows(call.size, ok, call.score, call.packed)
        done: list[Any] = []
        at = {id(r): r for r, _ in ok}
        for part in sched.split_call(call.size, [(id(r), n) for r, n in ok], planned=len(call.pieces),
                                     packs=call.packed is not None):
            done += self._prefill_rows(part.size, [(at[k], n) for k, n in part.pieces], call.score, part.packed)
        return done

    def _prefill_rows(self, size: int, pieces: list[tuple[Any, int]], score: bool = False,
                      packed: int | None = None) -> list[Any]:
        """One prefill_step (score=True: score_step, and each row's prompt logprobs from
        its logits at every position) over `pieces`; see `prefill`. packed: its products on
        that many packed rows (`prefill_step`'s pack; the plan packs only text rows on the
        base model). A failure of the call fails its rows only."""
        if not pieces:
            return []
        reqs = [r for r, _ in pieces]
        try:
            cap = self.budget.prefill_slots(len(reqs[0].ids))
            if all(r.pcache is None for r in reqs):
                cache = self.model.new_cache(len(reqs), cap, headroom=self.headroom)
            else:
                cache = stack_rows([r.pcache if r.pcache is not None
                                    else self.model.new_cache(1, cap, headroom=self.headroom)
                                    for r in reqs])
            for r in reqs:
                r.pcache = None  # the call owns the only reference (in-place K/V writes)
            starts = [r.prefilled for r in reqs]
            tokens = [r.ids[s : s + n] + [0] * (size - n) for (r, n), s in zip(pieces, starts)]
            t0 = time.perf_counter()
            step = score_step_compiled if score else prefill_step_compiled
            capture = step_capture(reqs)
            img = {}
            if self.model.vision is not None and any(r.image is not None for r in reqs):
                images = step_images([(r, s, n) for (r, n), s in zip(pieces, starts)],
                                     self.model.vision.config.image_token_index)
                img = {} if images is None else {"images": images}
            if packed is not None and not score:
                img["pack"] = packed
            out = step(
                self.params, cache, mx.array(tokens, mx.int32),
                mx.array([n for _, n in pieces], mx.int32),
                span=span_bucket(max(starts) + size, cap), adapters=self.adapters(reqs), capture=capture,
                **img,
            )
            logits, cache = out[0], out[1]
            captured = out[2] if capture is not None else None
            if score:
                all_logits = logits
                last = mx.array([n - 1 for _, n in pieces], mx.int32)
                logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
            host = time.perf_counter() - t0  # graph build + call; the rest is evaluation
            mx.eval(logits, *tree_leaves(cache), *([] if captured is None else [captured]))
            if score:
                for i, ((r, n), s) in enumerate(zip(pieces, starts)):
                    self._prompt_logprobs(r, all_logits[i, :n], s, n)
            t1 = time.perf_counter()
            self.prefill_calls += 1
        except Exception as e:
            for r in reqs:
                self.emitter.fail(r, e)
            return []
        finished = []
        for i, ((req, n), start) in enumerate(zip(pieces, starts)):
            try:
                if captured is not None:
                    observe_captured(req, capture, captured[i, :n], start, req.ids)
                req.pcache = row_view(cache, i)
                req.prefilled = start + n
                # one event per row, all with the call's id, end time and duration
                self.trace("prefill", t=t1, request=req.handle.id, tokens=n, padded=size,
                           packed=packed, start=start, rows=len(pieces), call=self.prefill_calls,
                           seconds=t1 - t0, host_seconds=host)
                if req.prefilled < len(req.ids):
                    self._keep(req, req.ids[: req.prefilled], req.pcache, 0)  # a chunk boundary
                else:
                    self._first_token(req, logits[i : i + 1])
                    finished.append(req)
            except Exception as e:
                self.emitter.fail(req, e)
        return finished

    def _first_token(self, req: Any, logits: mx.array) -> None:
        """Sample the first token of a request whose prompt is prefilled (a 1-row state:
        per-row keys, so the draw does not depend on the call's other rows) and emit it
        (a one-row emission, emit.py)."""
        row_state = init_state([req.cfg], [req.ids], self.vocab, special_token_ids=self.special)
        if req.plp is not None:
            req.handle.prompt_logprobs = tuple(req.out.prompt_lps)
        if req.max_tokens == 0:  # scoring only: the prompt is prefilled, nothing sampled
            self._keep(req, req.ids, req.pcache, 0)
            req.t_first = time.perf_counter()
            req.cache_len = len(req.ids)
            self.emitter.complete(req, "length")
            return
        if req.processors:
            logits = run_processors(req.processors, req.ids, logits)
        mask = batch_masks([req], self.vocab)  # a grammar error fails this prefill row
        row_state = sample_step_compiled(row_state, logits, mask)
        mx.eval(*tree_leaves(row_state))
        self._keep(req, req.ids, req.pcache, 0)  # the whole prompt
        t1 = time.perf_counter()
        self.trace("sample", request=req.handle.id)
        req.t_first = t1
        req.handle.timings["first_token"] = t1
        req.cache_len = len(req.ids)
        token = int(row_state.tokens[0].item())
        lps = None
        if req.want_logprobs:
            lps = ([float(row_state.logprob[0].item())], [row_state.top_ids[0].tolist()],
                   [row_state.top_logprobs[0].tolist()])
        req.row_state = row_state
        self.emitter.emit_tokens(req, [token], lps)

    def _prompt_logprobs(self, req: Any, logits: mx.array, start: int, n: int) -> None:
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

    # ---------------------------------------------------------------- decode / verify
    def _take_state(self, rows: Sequence[Any]) -> DecodeState:
        """The batch's state for a step: `active` = occupied rows, `full` cleared (after
        the step it names the rows that had no room). The batch lets go of it, so MLX may
        update its buffers in place."""
        batch = self.batch
        state = tree_replace(batch.state, active=mx.array([r is not None for r in rows]),
                             full=mx.zeros((len(rows),), mx.bool_))
        batch.state = None
        return state

    def decode(self, plan: DecodePlan) -> StepResult | None:
        """One decode step over the batch (None: no row left to run)."""
        batch = self.batch
        live = batch.live()
        max_len = max(r.cache_len for r in live)
        batch.ensure_capacity(plan.grow_to)  # may compact: row indices are read after it
        # before the rows are read: a grammar that fails fails its request
        mask = batch_masks(batch.rows, self.vocab, self.emitter.fail) if plan.masked else None
        rows = batch.rows
        if not any(r is not None for r in rows):
            return None
        state = self._take_state(rows)
        span = span_bucket(max_len + 1, batch.cache.capacity)
        capture = step_capture(rows)
        t0 = time.perf_counter()
        traces = decode_step_compiled.traces
        failed: dict[int, BaseException] = {}
        packed: dict[str, int] = {}
        if plan.split:  # a genuinely different step: forward, the processors, sampling
            state, cache, captured = self._decode_with_processors(state, span, failed, mask, capture)
        else:  # forward and sampling in one compiled step (mask=None: unconstrained)
            adapters = self.adapters(rows)
            # a batch with free rows (its row bucket above the live rows, until compaction
            # shrinks it): the products on the live rows' bucket alone
            pack = pow2_ceil(len(live)) if self.packs and adapters is None else None
            packed = {} if pack is None or pack >= len(rows) else {"pack": pack}
            out = decode_step_compiled(self.params, batch.cache, state, span=span,
                                       mask=mask, adapters=adapters, capture=capture, **packed)
            state, cache, captured = out[0], out[1], (out[2] if capture is not None else None)
        host = time.perf_counter() - t0
        batch.cache = None
        mx.eval(*tree_leaves(state), *tree_leaves(cache), *([] if captured is None else [captured]))
        batch.state, batch.cache = state, cache
        toks, full = state.tokens.tolist(), state.full.tolist()
        if captured is not None:
            self._observe(rows, capture, captured, [1] * len(rows), full, failed)
        lps = None
        if any(r.want_logprobs for r in live):
            lps = ([[v] for v in state.logprob.tolist()], [[v] for v in state.top_ids.tolist()],
                   [[v] for v in state.top_logprobs.tolist()])
        seconds = time.perf_counter() - t0
        if decode_step_compiled.traces == traces and not failed:
            self.policy.observe(len(rows), 0, seconds)
        self.trace("decode", batch=len(live), rows=len(rows), packed=packed.get("pack") if not plan.split else None,
                   capacity=cache.capacity, span=span, requests=[r.handle.id for r in live], seconds=seconds,
                   host_seconds=host)
        return StepResult(rows, [[t] for t in toks], [1] * len(rows), full, lps, failed=failed)

    def verify(self, plan: DecodePlan, drafts: dict[Any, Any]) -> StepResult | None:
        """One verify step over the whole batch: rows with drafts (`drafts`: row -> (tokens,
        probs), cut to the plan's K) verify them, the others decode (n_draft = 0 samples as
        a decode step does). None: no row left to run."""
        batch, k = self.batch, plan.k
        live = batch.live()
        # Room for each row's own drafts (padding goes to the sink); may compact the rows,
        # so row indices are read after it.
        batch.ensure_capacity(plan.grow_to)
        # Constrained rows: the mask at every verified position, and only the drafts their
        # grammar allows (may fail a request, so before the rows are read).
        masks = verify_masks(batch.rows, drafts, k, self.vocab, self.emitter.fail) if plan.masked else None
        rows = batch.rows
        if not any(r is not None for r in rows):
            return None
        arr, n_arr, probs, n = draft_inputs(rows, drafts, k, self.vocab)
        state = self._take_state(rows)
        max_len = max(r.cache_len for r in live)
        span = span_bucket(max_len + k + 1, batch.cache.capacity)
        capture = step_capture(rows)
        t0 = time.perf_counter()
        traces = verify_step_compiled.traces
        adapters = self.adapters(rows)
        # rows verifying fewer than K drafts (per-row K), and free rows: the products on the
        # live rows' tokens alone (their count bounds what the step runs: no row is cut)
        tokens = sum(1 + n[i] for i, r in enumerate(rows) if r is not None)
        packed = sched.pack_arg(tokens, len(rows) * (k + 1)) if self.packs and adapters is None else {}
        out = verify_step_compiled(
            self.params, batch.cache, state, arr, n_arr, probs, span=span, mask=masks,
            adapters=adapters, capture=capture, **packed)
        state, cache, res = out[0], out[1], out[2]
        captured = out[3] if capture is not None else None
        host = time.perf_counter() - t0
        batch.cache = None
        mx.eval(*tree_leaves(state), *tree_leaves(cache), *tree_leaves(res),
                *([] if captured is None else [captured]))
        batch.state, batch.cache = state, cache
        toks, counts, acc = res.tokens.tolist(), res.count.tolist(), res.accepted.tolist()
        full = state.full.tolist()
        failed: dict[int, BaseException] = {}
        if captured is not None:
            self._observe(rows, capture, captured, counts, full, failed)
        lps = None
        if any(r.want_logprobs for r in live):
            lps = (res.logprobs.tolist(), res.top_ids.tolist(), res.top_logprobs.tolist())
        seconds = time.perf_counter() - t0
        if verify_step_compiled.traces == traces:
            self.policy.observe(len(rows), k, seconds)
        self.trace("verify", batch=len(live), rows=len(rows), k=k, packed=packed.get("pack"), drafted=sum(n),
                   accepted=sum(acc),
                   capacity=cache.capacity, span=span, requests=[r.handle.id for r in live],
                   seconds=seconds, host_seconds=host)
        return StepResult(rows, toks, counts, full, lps, n, acc, failed=failed)

    def _observe(self, rows: Sequence[Any], capture: Any, captured: mx.array, kept: Sequence[int],
                 full: Sequence[bool], failed: dict[int, BaseException]) -> None:
        """After a decode or verify step that captured: each capturing row's drafter gets
        the states of its first kept[i] positions (from its cache length before the step;
        the emit loop advances that). A row that had no room or failed gets nothing; a
        drafter that raises fails its request only (`failed`: the emit loop fails it)."""
        for i, req in enumerate(rows):
            if req is None or full[i] or i in failed or not kept[i] or capture_of(req.drafter) is None:
                continue
            try:
                observe_captured(req, capture, captured[i, : kept[i]], req.cache_len,
                                 list(req.ids) + req.generated)
            except Exception as e:
                failed[i] = e

    def _decode_with_processors(
        self, state: DecodeState, span: int, failed: dict[int, BaseException],
        mask: mx.array | None = None, capture: Any = None,
    ) -> tuple[DecodeState, KVCache, mx.array | None]:
        """decode_step split in two around the rows' logits processors: the forward (a
        one-token prefill_step), the processors eagerly per row, then sample_step. A row
        whose processor raises keeps its unprocessed logits and is failed by the emit loop;
        the other rows are unaffected. Returns the captured states too (None: none asked)."""
        batch = self.batch
        out = prefill_step_compiled(
            self.params, batch.cache, state.tokens[:, None], state.active.astype(mx.int32),
            span=span, adapters=self.adapters(batch.rows), capture=capture,
        )
        logits, cache = out[0], out[1]
        captured = out[2] if capture is not None else None
        batch.cache = None
        rows = [logits[i : i + 1] for i in range(logits.shape[0])]
        for i, req in enumerate(batch.rows):
            if req is None or not req.processors:
                continue
            try:
                rows[i] = run_processors(req.processors, req.ids + req.generated, rows[i])
            except Exception as e:
                failed[i] = e
        return sample_step_compiled(state, mx.concatenate(rows, axis=0), mask), cache, captured
