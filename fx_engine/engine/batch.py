"""The decode batch: which request sits in which row, the batch's KVCache and its
DecodeState, and their surgery (insert a prefilled request into a free row, grow/shrink
the rows and the capacity, compaction). The decisions (buckets, targets) are the
scheduler's pure functions; this module executes them on the arrays.

Rows hold engine requests (any object with `row`, `cfg` and `cache_len`) or None (a free
row: inactive, length 0).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from fx_engine.core.cache import KVCache, with_lengths
from fx_engine.engine.kv_rows import insert_row, resize, take_rows
from fx_engine.core.sampling import SamplingConfig, make_sampling_params
from fx_engine.core.state import DecodeState, init_state
from fx_engine.core.tree import tree_leaves, tree_replace
from fx_engine.engine import scheduler as sched

__all__ = ["DecodeBatch", "insert_row", "insert_state_row", "take_state_rows", "pad_state_rows"]

GREEDY = SamplingConfig()


# --------------------------------------------------------------------------------------
# Pure row helpers
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
        full=put(state.full, row_state.full),
        logprob=put(state.logprob, row_state.logprob),
        top_ids=put(_fit_cols(state.top_ids, n, 0, False), _fit_cols(row_state.top_ids, n, 0, False)),
        top_logprobs=put(
            _fit_cols(state.top_logprobs, n, 0.0, False), _fit_cols(row_state.top_logprobs, n, 0.0, False)
        ),
        n_top=n,
    )


def take_state_rows(state: DecodeState, idx: mx.array, params: Any) -> DecodeState:
    """Rows `idx` of `state` (a gather), with `params`."""
    return tree_replace(
        state, tokens=state.tokens[idx], keys=state.keys[idx], history=state.history[idx],
        params=params, active=state.active[idx], full=state.full[idx], logprob=state.logprob[idx],
        top_ids=state.top_ids[idx], top_logprobs=state.top_logprobs[idx],
    )


def pad_state_rows(state: DecodeState, rows: int, params: Any) -> DecodeState:
    """`state` padded with free rows (inactive) to `rows` rows, with `params`."""
    def pad(x: mx.array, fill: Any) -> mx.array:
        extra = rows - x.shape[0]
        return mx.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)

    return tree_replace(
        state, tokens=pad(state.tokens, 0), keys=pad(state.keys, 0), history=pad(state.history, -1),
        params=params, active=pad(state.active, False), full=pad(state.full, False),
        logprob=pad(state.logprob, 0.0),
        top_ids=pad(state.top_ids, 0), top_logprobs=pad(state.top_logprobs, 0.0),
    )


# --------------------------------------------------------------------------------------
# The batch
# --------------------------------------------------------------------------------------


class DecodeBatch:
    """The decode batch's rows, cache and state (engine-thread only).

    `cache` and `state` are None while there is no batch. The decode steps take them
    (setting the attributes to None, so MLX may update the buffers in place) and put the
    results back. trace(kind, **fields) records the surgery (`resize`, `compact`).
    """

    def __init__(self, model: Any, headroom: int, vocab_size: int, special: list[int],
                 max_rows: int, kv_budget_tokens: int | None,
                 trace: Callable[..., None]) -> None:
        self.model = model
        self.headroom = headroom
        self.vocab_size = vocab_size
        self.special = special
        self.max_rows = max_rows
        self.kv_budget_tokens = kv_budget_tokens
        self.trace = trace
        self.rows: list[Any] = []
        self.cache: KVCache | None = None
        self.state: DecodeState | None = None

    # ---- queries ----
    def live(self) -> list[Any]:
        return [r for r in self.rows if r is not None]

    def any_live(self) -> bool:
        return any(r is not None for r in self.rows)

    def row_params(self) -> Any:
        """SamplingParams rebuilt from the rows' configs (free rows count as greedy)."""
        cfgs = [r.cfg if r is not None else GREEDY for r in self.rows]
        return make_sampling_params(cfgs, self.vocab_size, self.special)

    # ---- surgery ----
    def insert(self, req: Any, pcache: KVCache, row_state: DecodeState, length: int) -> int:
        """Put a prefilled request (its 1-row cache's first `length` positions and its
        1-row state) into the lowest free row, growing the batch (rows: the next bucket
        only when no row is free; capacity: room for length + 1) as needed. Returns the
        row; the arrays are evaluated."""
        if self.cache is None:
            self.resize_rows(1, capacity=sched.capacity_bucket(length + 1))
        self.ensure_capacity(length + 1)
        row = self.free_row()
        self.rows[row] = req
        req.row = row
        params = self.row_params()
        self.cache = insert_row(self.cache, pcache, row, length)
        self.state = insert_state_row(self.state, row_state, row, params)
        mx.eval(*tree_leaves(self.cache), *tree_leaves(self.state))
        return row

    def release(self, row: int) -> None:
        """Free a row: no request, length 0 (it is inactive from the next step on)."""
        self.rows[row] = None
        if self.cache is not None:
            mask = mx.arange(len(self.rows)) == row
            self.cache = with_lengths(self.cache, mx.where(mask, 0, self.cache.lengths))

    def drop(self) -> None:
        self.cache, self.state, self.rows = None, None, []

    def free_row(self) -> int:
        for i, r in enumerate(self.rows):
            if r is None:
                return i
        live = len(self.rows)
        self.resize_rows(sched.row_bucket(live + 1, self.max_rows))
        return live

    def resize_rows(self, rows: int, capacity: int = sched.MIN_CAPACITY) -> None:
        """Grow to `rows` rows (free ones appended); a new batch gets `capacity`."""
        old = len(self.rows)
        self.rows = self.rows + [None] * (rows - old)
        if self.cache is None:
            self.cache = self.model.new_cache(rows, capacity, headroom=self.headroom)
            self.state = init_state([GREEDY] * rows, [[0]] * rows, self.vocab_size, self.special)
            self.state = tree_replace(self.state, active=mx.zeros((rows,), mx.bool_))
        else:
            self.cache = resize(self.cache, rows=rows)
            self.state = pad_state_rows(self.state, rows, self.row_params())
        self.trace("resize", rows=rows, capacity=self.cache.capacity)

    def ensure_capacity(self, needed: int) -> None:
        """Room for `needed` positions in every row (`scheduler.plan_growth`: compacts
        first when the grown batch would exceed the KV budget)."""
        if self.cache is None:
            return
        compact_to, cap = sched.plan_growth(
            needed, len(self.rows), sum(r is not None for r in self.rows), self.cache.capacity,
            self.max_rows, self.kv_budget_tokens)
        if cap is None:
            return
        if compact_to is not None:
            self.compact(compact_to)
        self.cache = resize(self.cache, capacity=cap)
        self.trace("resize", rows=len(self.rows), capacity=cap)

    def compact(self, target: int) -> None:
        """Gather the live rows into rows 0..live-1 of a `target`-row batch (a copy)."""
        rows = len(self.rows)
        live_idx = [i for i, r in enumerate(self.rows) if r is not None]
        spare = [r for r in range(rows) if r not in live_idx]
        idx = live_idx + spare[: max(0, target - len(live_idx))]
        gather = mx.array(idx, mx.int32)
        self.cache = take_rows(self.cache, gather)
        self.rows = [self.rows[i] for i in live_idx] + [None] * (len(idx) - len(live_idx))
        for i, r in enumerate(self.rows):
            if r is not None:
                r.row = i
        self.state = take_state_rows(self.state, gather, self.row_params())
        mask = mx.arange(len(idx)) >= len(live_idx)
        self.cache = with_lengths(self.cache, mx.where(mask, 0, self.cache.lengths))
        if len(idx) < target:
            self.resize_rows(target)
        self.trace("compact", rows=len(self.rows), live=len(live_idx))

    def maintain(self, prefilling: bool) -> None:
        """The upkeep after a step (`scheduler.plan_maintenance`): drop an empty batch
        (unless requests are still prefilling), compact, shrink the capacity."""
        if self.cache is None:
            return
        live_idx = [i for i, r in enumerate(self.rows) if r is not None]
        plan = sched.plan_maintenance(
            live_idx, [self.rows[i].cache_len for i in live_idx], len(self.rows),
            self.cache.capacity, self.max_rows, self.kv_budget_tokens, prefilling)
        if plan.drop:
            self.drop()
            self.trace("resize", rows=0, capacity=0)
            return
        if plan.compact_to is not None:
            self.compact(plan.compact_to)
        if plan.capacity_to is not None:
            self.cache = resize(self.cache, capacity=plan.capacity_to)
            self.trace("resize", rows=len(self.rows), capacity=plan.capacity_to)
