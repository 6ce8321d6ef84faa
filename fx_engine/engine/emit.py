"""Emit: turning what a step sampled into each request's events, and finishing requests.

Every sampled token takes one path (`Emitter.emit_tokens`): the testing fault hook, the
row's grammar consumes it, its `TokenOutput` (output.py: detokenizing, stop strings,
logprob records, the length limit) makes the `TextDelta` the handle receives, and a
finish reason completes the request. A decode step and a verify step return the same
shape (`StepResult`: per row, the tokens it emits in order), and one loop
(`Emitter.emit_result`) goes over it; a request's first token, sampled after its prefill,
is a one-row emission through the same path.

Finishing (`complete`, `fail`, `release`) frees the request's row or prefill state at
once, keeps the conversation's KV for later requests (`keep_prefix`), and ends the handle.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from fx_engine.core.cache import KVCache
from fx_engine.engine.image_prompt import prefix_key
from fx_engine.engine.kv_rows import snapshot_row
from fx_engine.engine.request import Usage

__all__ = ["StepResult", "Emitter", "keep_prefix"]


@dataclass
class StepResult:
    """What a decode or verify step returns to the emit loop (host lists, read back once).

    rows: the batch's rows as the step ran (requests, None for free rows). tokens[i]: the
    tokens row i emits, in order (decode: one; verify: its accepted drafts and the
    correction or bonus token), count[i] of them. full[i]: the row had no room (the batch
    could not grow): it stops with "length". logprobs: (values, top ids, top values), each
    [row][token], or None when no row asked. drafted[i] / accepted[i]: the row's drafts
    verified and accepted (0: it decoded). failed: rows whose logits processors raised.
    """

    rows: Sequence[Any]
    tokens: list[list[int]]
    count: list[int]
    full: list[bool]
    logprobs: tuple[list, list, list] | None = None
    drafted: list[int] | None = None
    accepted: list[int] | None = None
    failed: dict[int, BaseException] = field(default_factory=dict)


def keep_prefix(store: Any, trace: Callable[..., None], req: Any, tokens: Sequence[int],
                cache: KVCache, row: int) -> None:
    """Keep row `row`'s first len(tokens) positions for later requests with the same
    cache_salt (a copy of those tokens only, made now: the source cache is updated in
    place afterwards). A failure only loses the entry (traced)."""
    if store is None or len(tokens) < 1:
        return
    try:
        # (an image prompt's entries are keyed by its images' content: image_prompt.prefix_key)
        store.add(prefix_key(req.image, tokens), snapshot_row(cache, row, len(tokens)), salt=req.salt)
    except Exception as e:
        trace("prefix_error", error=repr(e))


class Emitter:
    """Events to the handles, and the end of requests (engine-thread only).

    batch: the DecodeBatch (rows are freed in it); prefilling: the engine's list of
    prefilling requests (the same list object for the engine's life); prefix_store: the
    PrefixStore or None; trace(kind, **fields). `fault_hook` (testing) is set by the
    engine.
    """

    def __init__(self, batch: Any, prefilling: list, prefix_store: Any,
                 trace: Callable[..., None]) -> None:
        self.batch = batch
        self.prefilling = prefilling
        self.prefix_store = prefix_store
        self.trace = trace
        self.fault_hook: Callable[[str, Any], None] | None = None

    # ---- tokens
    def emit_result(self, res: StepResult) -> None:
        """The one emit loop of decode and verify steps: per row, in row order, a stop for
        a row that had no room, then its tokens through `emit_tokens` (a row's failure,
        its processors' or its own per-token work, fails that request only)."""
        lps = res.logprobs
        for row, req in enumerate(res.rows):
            if req is None:
                continue
            if res.full[row]:  # no room for its token (the batch could not grow): stopped
                self.complete(req, "length")
                continue
            req.cache_len += res.count[row]
            if row in res.failed:  # its logits processor raised: this request only
                self.fail(req, res.failed[row])
                continue
            if res.drafted is not None and res.drafted[row]:
                req.spec.adapt(res.drafted[row], res.accepted[row])
            try:
                self.emit_tokens(req, res.tokens[row][: res.count[row]],
                                 None if lps is None else (lps[0][row], lps[1][row], lps[2][row]))
            except Exception as e:
                self.fail(req, e)

    def emit_tokens(self, req: Any, tokens: Sequence[int], lps: tuple | None) -> bool:
        """A row's tokens of this step, in order, until one finishes the request (the rest
        is dropped). lps: (values, top ids, top values) per token, read when the request
        asked for logprobs. Returns whether the request finished."""
        for i, token in enumerate(tokens):
            lp = None
            if req.want_logprobs:
                lp = req.out.logprob(token, lps[0][i], lps[1][i], lps[2][i])
            if self.on_token(req, token, lp):
                return True
        return False

    def on_token(self, req: Any, token: int, lp: Any) -> bool:
        """One sampled token through the request's output, its event to the handle.
        Returns True if it finished the request."""
        if self.fault_hook is not None:
            self.fault_hook("token", req.handle)
        if req.grammar is not None:
            req.grammar.consume(token)
        delta, reason = req.out.add(token, lp)
        if delta is not None:
            req.handle._emit(delta)
        if reason is not None:
            self.complete(req, reason)
            return True
        return False

    # ---- the end of a request
    def complete(self, req: Any, reason: str) -> None:
        """Finish with `reason`: keep the conversation's KV, the held-back tail and the
        usage as the last event, the Completion as the handle's result."""
        batch = self.batch
        if req.row is not None and batch.cache is not None and batch.rows[req.row] is req:
            # the conversation so far (prompt + generated tokens in the cache) for later turns
            keep_prefix(self.prefix_store, self.trace, req,
                        (list(req.ids) + req.generated)[: req.cache_len], batch.cache, req.row)
        tail = req.out.finish(reason)
        now = time.perf_counter()
        t_first = req.t_first or now
        usage = Usage(
            prompt_tokens=len(req.ids), completion_tokens=len(req.generated),
            cached_tokens=req.cached,
            prompt_seconds=(t_first - req.t_admit) if req.t_admit else 0.0,
            generation_seconds=now - t_first,
            drafted_tokens=req.spec.drafted, accepted_tokens=req.spec.accepted,
            draft_rounds=req.spec.rounds, drafter=drafter_kind(req.drafter) if req.spec.rounds else None,
        )
        h = req.handle
        h.timings["finished"] = now
        completion = req.out.completion(reason, usage, req.ids)
        self.release(req, reason)
        h._emit(req.out.final_delta(tail, reason, usage))
        h._finish(completion, None)

    def fail(self, req: Any, error: BaseException) -> None:
        """Finish with an error (the handle raises it); a finished request is left alone."""
        if req.phase == "done":
            return
        self.release(req, "error", error=repr(error))
        req.handle.timings["finished"] = time.perf_counter()
        req.handle._finish(None, error)

    def release(self, req: Any, reason: str, **fields: Any) -> None:
        """Retire: free the row (inactive, length 0) or drop the prefill state."""
        phase, req.phase = req.phase, "done"
        if phase == "prefill" and req in self.prefilling:
            self.prefilling.remove(req)
        rows = self.batch.rows
        if req.row is not None and rows and rows[req.row] is req:
            self.batch.release(req.row)
        req.pcache = None
        self.trace("retire", request=req.handle.id, row=req.row, reason=reason,
                   generated=len(req.generated), **fields)
        req.row = None


def drafter_kind(drafter: Any) -> str | None:
    """A drafter's name in usage and /metrics: its `kind` attribute, else its class name in
    snake case (PromptLookup -> "prompt_lookup", DraftModel -> "draft_model")."""
    if drafter is None:
        return None
    kind = getattr(drafter, "kind", None)
    return kind if isinstance(kind, str) else re.sub(r"(?<!^)(?=[A-Z])", "_", type(drafter).__name__).lower()
