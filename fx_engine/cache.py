"""The KV cache pytree: preallocated rows with per-row lengths, written in place.

Layout: one K and one V array per layer, each [B, Hkv, C, D] (B rows, capacity C). Rows
are independent: row b holds `lengths[b]` valid positions; entries at or past that length
are stale and never read (attention masks them), which is what makes rollback by length
exact and free: `with_lengths(cache, accepted)`.

One extra slot past the capacity (index `capacity`) is a write sink: padding tokens, rows
that do not advance (n_valid == 0) and anything that would land past the capacity are
written there, so a step never touches a row's valid entries nor memory outside the array.
Attention never reads it (spans are <= capacity).

Why one array per layer (not a stacked [L, ...] array): MLX reuses an input buffer for an
update only when nothing else references it; a stacked cache is copied whole every step.
Why zero-initialised: a NaN in a masked V slot still poisons the row (0 * NaN).
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from jaxtyping import Int

from .tree import tree_replace


@attrs.frozen
class KVCache:
    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]
    lengths: Int[mx.array, "B"]

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        """Usable slots per row (the array has one more: the write sink)."""
        return int(self.keys[0].shape[2]) - 1

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def init_cache(
    num_layers: int, rows: int, num_kv_heads: int, capacity: int, head_dim: int,
    dtype: mx.Dtype = mx.float32,
) -> KVCache:
    shape = (rows, num_kv_heads, capacity + 1, head_dim)  # + the write sink
    return KVCache(
        keys=tuple(mx.zeros(shape, dtype) for _ in range(num_layers)),
        values=tuple(mx.zeros(shape, dtype) for _ in range(num_layers)),
        lengths=mx.zeros((rows,), mx.int32),
    )


def write_positions(lengths: mx.array, t: int) -> mx.array:
    """Absolute positions [B, T] where a chunk of T tokens per row is written."""
    return lengths[:, None] + mx.arange(t, dtype=mx.int32)[None, :]


def write_slots(lengths: mx.array, n_valid: mx.array, t: int, capacity: int) -> mx.array:
    """Cache slots [B, T] for a chunk: its position for a valid token inside the capacity,
    else the write sink (index `capacity`). Computed once per step, shared by all layers."""
    offs = mx.arange(t, dtype=mx.int32)[None, :]
    pos = lengths[:, None] + offs
    keep = (offs < n_valid[:, None]) & (pos < capacity)
    return mx.where(keep, pos, capacity)


def write_layer(cache_k: mx.array, new: mx.array, slots: mx.array) -> mx.array:
    """Write new [B, H, T, D] at per-row slots [B, T] (from `write_slots`).

    put_along_axis reuses cache_k's buffer when the caller holds no other reference.
    """
    idx = slots[:, None, :, None]
    return mx.put_along_axis(cache_k, idx, new.astype(cache_k.dtype), axis=2)


def attention_mask(lengths: mx.array, t: int, capacity: int) -> mx.array:
    """Bool mask [B, 1, T, C]: query t of row b sees keys at positions <= lengths[b] + t."""
    q_pos = write_positions(lengths, t)  # [B, T]
    k_pos = mx.arange(capacity, dtype=mx.int32)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]


def span_bucket(needed: int, capacity: int) -> int:
    """The attention span (a static shape) for `needed` slots: rounded up to a multiple of a
    quarter of the power of two below it (min 256), capped at capacity. CPU attention costs
    time linear in the span, and each distinct span is one compiled graph: four per octave
    keeps the waste under 25% (above 1024) and the compiles few."""
    if needed >= capacity:
        return capacity
    lower = 1 << max(0, (needed - 1).bit_length() - 1)  # needed is in (lower, 2 * lower]
    step = max(256, lower // 4)
    return min(capacity, -(-needed // step) * step)


def with_lengths(cache: KVCache, lengths: mx.array) -> KVCache:
    """Rollback (or commit) by length: entries past each row's length become stale."""
    return tree_replace(cache, lengths=lengths.astype(mx.int32))


def resize(cache: KVCache, rows: int | None = None, capacity: int | None = None) -> KVCache:
    """Grow or shrink a cache to another (rows, capacity) bucket, keeping the leading rows.

    A shell operation between steps (copies once per bucket change, never per step).
    """
    b = cache.rows
    rows = b if rows is None else rows
    capacity = cache.capacity if capacity is None else capacity

    def fit(x: mx.array) -> mx.array:
        x = x[:rows, :, :capacity]  # drops the old sink; a fresh zero sink is padded on
        pad_b, pad_c = rows - x.shape[0], capacity + 1 - x.shape[2]
        if pad_b or pad_c:
            x = mx.pad(x, [(0, pad_b), (0, 0), (0, pad_c), (0, 0)])
        return x

    lengths = cache.lengths[:rows]
    if rows > lengths.shape[0]:
        lengths = mx.concatenate([lengths, mx.zeros((rows - lengths.shape[0],), mx.int32)])
    return KVCache(
        keys=tuple(fit(k) for k in cache.keys),
        values=tuple(fit(v) for v in cache.values),
        lengths=mx.minimum(lengths, capacity),
    )


def take_rows(cache: KVCache, rows: mx.array) -> KVCache:
    """Gather rows (e.g. to compact a batch or copy one row's prefix)."""
    return KVCache(
        keys=tuple(k[rows] for k in cache.keys),
        values=tuple(v[rows] for v in cache.values),
        lengths=cache.lengths[rows],
    )
