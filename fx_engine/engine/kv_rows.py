"""Row surgery on a KVCache between steps (the shell's side of the cache): resize to another
(rows, capacity) bucket, gather or stack rows, view one row, copy a prefilled row in, take
a snapshot of one row for the prefix store.

These run between steps, never inside a compiled one; some read a row's length back to the
host (`.item()`), which is why they live in the shell, beside the batch they serve
(batch.py, engine.py, prefix_cache.py). The rules they share with the pure core (the
layout, the ring rule `prefix_in_cache`) stay in fx_engine.core.cache.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from fx_engine.core.cache import (CacheError, KVCache, LayerKV, LayerSpec, QuantKV, RecState, entry_arrays, prefix_in_cache, quant_head_slots)

__all__ = ["insert_row", "resize", "row_view", "snapshot_row", "stack_rows", "take_rows"]


def _fit(x: mx.array, rows: int, slots: int) -> mx.array:
    """[B, H, S, *] -> [rows, H, slots, *]: truncate or zero-pad rows and slots."""
    x = x[:rows, :, :slots]
    pad_b, pad_s = rows - x.shape[0], slots - x.shape[2]
    if pad_b or pad_s:
        x = mx.pad(x, [(0, pad_b), (0, 0), (0, pad_s)] + [(0, 0)] * (x.ndim - 3))
    return x



def _fit_rows(x: mx.array, rows: int) -> mx.array:
    x = x[:rows]
    if rows > x.shape[0]:
        x = mx.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return x


def _resize_entry(entry: Any, spec: LayerSpec, rows: int, old_cap: int, cap: int) -> Any:
    if spec.state:  # a recurrent state does not depend on the capacity
        return RecState(tuple(_fit_rows(a, rows) for a in entry.arrays))
    if spec.ring:  # the ring does not depend on the capacity; the old sink is kept (never read)
        return LayerKV(_fit(entry.keys, rows, spec.ring + 1), _fit(entry.values, rows, spec.ring + 1))
    if spec.bits:
        f_old, f = quant_head_slots(spec, old_cap), quant_head_slots(spec, cap)
        # Quantized positions sit at p - f; when f changes, every valid position is in the
        # head before and after (capacity below quant_start on one side), the tail is empty.
        tail = (lambda a: _fit(a[:, :, : cap - f], rows, cap - f + 1)) if f == f_old else (
            lambda a: mx.zeros((rows, a.shape[1], cap - f + 1, a.shape[3]), a.dtype))
        return QuantKV(
            head_keys=_fit(entry.head_keys[:, :, :f], rows, f + 1),
            head_values=_fit(entry.head_values[:, :, :f], rows, f + 1),
            keys=tuple(tail(a) for a in entry.keys), values=tuple(tail(a) for a in entry.values),
        )
    # drops the old sink; a fresh zero sink is padded on
    return LayerKV(_fit(entry.keys[:, :, :cap], rows, cap + 1),
                   _fit(entry.values[:, :, :cap], rows, cap + 1))



def resize(cache: KVCache, rows: int | None = None, capacity: int | None = None) -> KVCache:
    """Grow or shrink a cache to another (rows, capacity) bucket, keeping the leading rows.

    A shell operation between steps (copies once per bucket change, never per step).
    """
    rows = cache.rows if rows is None else rows
    capacity = cache.capacity if capacity is None else capacity
    lengths = cache.lengths[:rows]
    if rows > lengths.shape[0]:
        lengths = mx.concatenate([lengths, mx.zeros((rows - lengths.shape[0],), mx.int32)])
    return KVCache(
        layers=tuple(_resize_entry(e, s, rows, cache.capacity, capacity)
                     for e, s in zip(cache.layers, cache.layout)),
        lengths=mx.minimum(lengths, capacity), layout=cache.layout, capacity=capacity,
    )



def _map_arrays(entry: Any, fn: Callable[[mx.array], mx.array]) -> Any:
    if isinstance(entry, RecState):
        return RecState(tuple(fn(a) for a in entry.arrays))
    if isinstance(entry, QuantKV):
        return QuantKV(fn(entry.head_keys), fn(entry.head_values),
                       tuple(fn(a) for a in entry.keys), tuple(fn(a) for a in entry.values))
    return LayerKV(fn(entry.keys), fn(entry.values))



def take_rows(cache: KVCache, rows: mx.array) -> KVCache:
    """Gather rows (e.g. to compact a batch or copy one row's prefix)."""
    return KVCache(
        layers=tuple(_map_arrays(e, lambda a: a[rows]) for e in cache.layers),
        lengths=cache.lengths[rows], layout=cache.layout, capacity=cache.capacity,
    )



def stack_rows(caches: Sequence[KVCache]) -> KVCache:
    """One cache whose row i is row 0 of caches[i] (1-row caches of one layout and
    capacity): a copy, so a batched prefill call can own it (and update it in place)."""
    first = caches[0]
    for c in caches:
        if c.layout != first.layout or c.capacity != first.capacity or c.rows != 1:
            raise CacheError("stack_rows: caches must be 1-row with one layout and capacity")
    if len(caches) == 1:
        return first
    layers = []
    for i, spec in enumerate(first.layout):
        parts = [entry_arrays(c.layers[i]) for c in caches]
        stacked = [mx.concatenate(list(col), axis=0) for col in zip(*parts)]
        if isinstance(first.layers[i], RecState):
            layers.append(RecState(tuple(stacked)))
        elif isinstance(first.layers[i], QuantKV):
            layers.append(QuantKV(stacked[0], stacked[1], tuple(stacked[2:5]), tuple(stacked[5:8])))
        else:
            layers.append(LayerKV(stacked[0], stacked[1]))
    return KVCache(layers=tuple(layers), lengths=mx.concatenate([c.lengths for c in caches]),
                   layout=first.layout, capacity=first.capacity)



def row_view(cache: KVCache, row: int) -> KVCache:
    """Row `row` as a 1-row cache (slices: views of the same buffers, no copy)."""
    if cache.rows == 1 and row == 0:
        return cache
    return KVCache(
        layers=tuple(_map_arrays(e, lambda a: a[row : row + 1]) for e in cache.layers),
        lengths=cache.lengths[row : row + 1], layout=cache.layout, capacity=cache.capacity,
    )



def _copy_slots(dst: mx.array, src: mx.array, row: int, n: int) -> mx.array:
    if n <= 0:
        return dst
    start = mx.array([row] + [0] * (dst.ndim - 1), mx.int32)
    return mx.slice_update(dst, src[:1, :, :n].astype(dst.dtype), start, tuple(range(dst.ndim)))



def _copy_row(dst: mx.array, src: mx.array, row: int) -> mx.array:
    start = mx.array([row] + [0] * (dst.ndim - 1), mx.int32)
    return mx.slice_update(dst, src[:1].astype(dst.dtype), start, tuple(range(dst.ndim)))


def _insert_entry(dst: Any, src: Any, spec: LayerSpec, row: int, length: int) -> Any:
    if spec.state:  # the state after the source row's length (== length: checked by the caller)
        return RecState(tuple(_copy_row(d, s, row) for d, s in zip(dst.arrays, src.arrays)))
    if spec.ring:  # slot == position until the ring wraps; after that the whole ring
        n = min(length, spec.ring)
        return LayerKV(_copy_slots(dst.keys, src.keys, row, n),
                       _copy_slots(dst.values, src.values, row, n))
    if spec.bits:
        f = min(dst.head_slots, src.head_slots)
        nh = min(length, f)
        nt = length - nh  # > 0 only when both heads hold quant_start positions
        return QuantKV(
            _copy_slots(dst.head_keys, src.head_keys, row, nh),
            _copy_slots(dst.head_values, src.head_values, row, nh),
            tuple(_copy_slots(d, s, row, nt) for d, s in zip(dst.keys, src.keys)),
            tuple(_copy_slots(d, s, row, nt) for d, s in zip(dst.values, src.values)),
        )
    return LayerKV(_copy_slots(dst.keys, src.keys, row, length),
                   _copy_slots(dst.values, src.values, row, length))



def insert_row(cache: KVCache, row_cache: KVCache, row_index: int, length: int | None = None) -> KVCache:
    """Copy row 0 of `row_cache` (same layout; its first `length` positions, default its
    length) into row `row_index` of `cache`, and set that row's length. Slice updates: MLX
    writes in place when the caller holds no other reference to `cache` (rebind before eval)."""
    if row_cache.layout != cache.layout:
        raise CacheError("insert_row: the two caches have different layouts")
    if length is None:
        length = int(row_cache.lengths[0].item())
    if length > cache.capacity:
        raise CacheError(f"insert_row: length {length} exceeds capacity {cache.capacity}")
    if any(s.ring or s.state for s in cache.layout):
        src_len = int(row_cache.lengths[0].item())
        if not prefix_in_cache(cache.layout, src_len, length):
            what = ("a recurrent state (only the whole row)" if any(s.state for s in cache.layout)
                    else f"a wrapped {min(s.ring for s in cache.layout if s.ring)}-slot ring")
            raise CacheError(f"insert_row: cannot copy a {length}-position prefix of a row of "
                             f"length {src_len} from {what}")
    layers = tuple(_insert_entry(d, s, spec, row_index, length)
                   for d, s, spec in zip(cache.layers, row_cache.layers, cache.layout))
    lengths = mx.slice_update(
        cache.lengths, mx.array([length], mx.int32), mx.array([row_index], mx.int32), (0,)
    )
    return KVCache(layers=layers, lengths=lengths, layout=cache.layout, capacity=cache.capacity)



def snapshot_row(cache: KVCache, row: int, length: int) -> KVCache:
    """A 1-row copy of row `row`'s first `length` positions (capacity `length`), in new
    buffers: only those tokens are copied, and the snapshot holds no reference to the
    cache's arrays (so the decode loop keeps updating them in place). Ring entries keep
    their whole ring: the positions a window needs, valid for exactly this length."""
    def cut(x: mx.array, n: int) -> mx.array:
        part = x[row : row + 1, :, :n]
        sink = mx.zeros((1, *part.shape[1:2], 1, *part.shape[3:]), part.dtype)
        return mx.concatenate([part, sink], axis=2)  # a new buffer, never a view

    layers = []
    for e, s in zip(cache.layers, cache.layout):
        if s.state:  # the state after the row's current length: valid for exactly that length
            if length != int(cache.lengths[row].item()):
                raise CacheError(f"snapshot_row: a recurrent state holds the row's {int(cache.lengths[row].item())} "
                                 f"positions, not a prefix of {length}")
            layers.append(RecState(tuple(mx.contiguous(a[row : row + 1]) for a in e.arrays)))
        elif s.ring:
            layers.append(LayerKV(cut(e.keys, s.ring), cut(e.values, s.ring)))
        elif s.bits:
            f = quant_head_slots(s, length)
            layers.append(QuantKV(cut(e.head_keys, f), cut(e.head_values, f),
                                  tuple(cut(a, length - f) for a in e.keys),
                                  tuple(cut(a, length - f) for a in e.values)))
        else:
            layers.append(LayerKV(cut(e.keys, length), cut(e.values, length)))
    return KVCache(layers=tuple(layers), lengths=mx.array([length], mx.int32),
                   layout=cache.layout, capacity=length)
