"""Packed rows (pure): a multi-row forward whose row-wise work runs on the valid tokens only.

A prefill step over B rows of T tokens pads every row to T; the projections and MLPs (all
of a step's matrix products, ~98% of its work at short spans) then multiply B*T rows, the
padding included. With `pack=R` the residual stream holds the valid tokens alone, row
after row ([R, hidden], R >= sum(n_valid)), and only attention sees the [B, T] layout:
each attention block unpacks its projection's output to B*T rows (`unpack`), attends and
writes the cache as always, and packs its output again (`pack`) before the output
projection. Eight chat prompts of 25-110 tokens padded to their buckets were 528 rows of
products for 429 tokens, and several calls; packed they are one call of 448 rows.

Tokens that do not fit in R (R < sum(n_valid)) are not processed at all, as tokens past
the cache's capacity are not: `fitted` cuts each row's count to what fits (rows in
order), the row's length stops there and the steps mark its outputs NaN
(`steps.prefill_step`), never silently wrong. Where a row's products do not depend on the
row count (the native kernels, the batch-invariant mode) a packed step's outputs equal the
padded step's bit for bit; float weights through MLX's matmul may differ in the last bit,
as they do between batch sizes.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from jaxtyping import Int

__all__ = ["check_pack", "fitted", "on_packed", "pack_index", "unpack_index"]


def check_pack(pack: object, adapters: Any = None) -> int | None:
    """`pack` as the steps take it: None (no packing) or an int >= 1, and no adapters with
    it (ValueError naming the field: each batch row's adapter applies to its padded rows)."""
    if pack is None:
        return None
    if isinstance(pack, bool) or not isinstance(pack, int) or pack < 1:
        raise ValueError(f"pack must be None or an int >= 1 (rows the packed tokens fill, at least "
                         f"the step's valid tokens), got {pack!r}")
    if adapters is not None:
        raise ValueError("pack: a step with adapters does not run on packed rows (each batch row's "
                         "adapter applies to its padded rows); pass pack=None")
    return pack


def _starts(n: Int[mx.array, "B"]) -> Int[mx.array, "B"]:
    """Where each row's tokens start among the packed rows (exclusive prefix sum)."""
    return mx.cumsum(n) - n


def fitted(n_valid: Int[mx.array, "B"], pack: int) -> Int[mx.array, "B"]:
    """Each row's valid tokens that fit in `pack` packed rows, rows filled in order."""
    return mx.minimum(n_valid, mx.maximum(pack - _starts(n_valid), 0))


def unpack_index(n_fit: Int[mx.array, "B"], t: int) -> Int[mx.array, "BT"]:
    """For each of the B*T padded positions, the packed row holding it (padding: row 0,
    whose values go nowhere: padded positions write the cache's sink and are never read)."""
    offs = mx.arange(t, dtype=mx.int32)[None, :]
    at = _starts(n_fit)[:, None] + offs
    return mx.where(offs < n_fit[:, None], at, 0).reshape(-1)


def on_packed(fn: Callable[[mx.array], mx.array], x: mx.array, n_fit: Int[mx.array, "B"], t: int,
              pack: int) -> mx.array:
    """fn (row-wise: an output head) on the packed rows of x [B*T, ...] only, its result
    spread back to [B*T, ...] (padding positions: another position's row, never read)."""
    y = fn(mx.take(x, pack_index(n_fit, t, pack), axis=0))
    return mx.take(y, unpack_index(n_fit, t), axis=0)


def pack_index(n_fit: Int[mx.array, "B"], t: int, pack: int) -> Int[mx.array, "R"]:
    """For each of the `pack` packed rows, its padded position b*T + i (rows past the
    valid tokens: position 0, computed and never read)."""
    rows = n_fit.shape[0]
    starts = _starts(n_fit)
    j = mx.arange(pack, dtype=mx.int32)
    b = mx.sum((starts + n_fit)[None, :] <= j[:, None], axis=1).astype(mx.int32)  # row of packed j
    inside = b < rows
    b = mx.minimum(b, rows - 1)
    return mx.where(inside, b * t + (j - mx.take(starts, b)), 0)
