"""Row operations on the step pytrees: take, reorder, repeat, fork, concatenate rows.

    take_rows(tree, idx)       rows idx (any order, repeats allowed: reorder, fork, select)
    repeat_rows(tree, n)       each row n times in a row (row b -> rows b*n .. b*n + n - 1)
    concat_rows([t1, t2, ..])  the rows of several trees of one structure, in order
    num_rows(tree)             B

`tree` is a KVCache, a DecodeState, SamplingParams, a VerifyResult, an mx.array (rows on
axis 0), or a tuple / list / dict of those: `take_rows((state, cache), idx)` keeps a state
and its cache in step. Why not `tree_map(lambda a: a[idx], ...)`: that is right only if
every leaf of every kind has its rows first; here each kind's row axis is stated, and an
unknown node is an error instead of a silent misindex.

The row-axis contract (specs/steps.md): every array of these types has the row axis first.
A row carries everything its position needs, so moving rows is exact for every cache kind:

    dense, latent (MLA)   K, V [B, Hkv, slots + 1, D]   slot p holds position p
    ring                  K, V [B, Hkv, R + 1, D]       slot p mod R; which position a slot
                                                        holds follows from the row's length
    quantized             head K/V [B, Hkv, F + 1, D], packed/scales/biases [B, Hkv, *, *]
    recurrent             state arrays [B, *shape] (and, inside a verify step, steps
                          [B, T + 1, *shape])
    lengths [B]; DecodeState: tokens, keys, history, active, full, logprob, top_ids,
    top_logprobs, and every SamplingParams array ([B] or [B, V or 0]).

These are pure (gathers: new arrays, also under `jit`), so a row taken out is a snapshot:
later steps on the source do not change it. MLX updates a cache in place only when nothing
else references it, so evaluate a snapshot (`mx.eval`) before the next step on the source,
or that step copies the source instead of writing in place.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import mlx.core as mx
from jaxtyping import Int

from fx_engine.core.cache import KVCache, LayerKV, QuantKV, RecState
from fx_engine.core.checks import to_int_array
from fx_engine.core.sampling import SamplingParams
from fx_engine.core.speculative import VerifyResult
from fx_engine.core.state import DecodeState
from fx_engine.core.tree import tree_flatten, tree_replace, tree_unflatten

__all__ = ["concat_rows", "num_rows", "repeat_rows", "take_rows"]

Fn = Callable[[mx.array], mx.array]


def _entry(e: Any, fn: Fn) -> Any:
    """One cache entry with `fn` applied to each of its (row-first) arrays, by kind."""
    if isinstance(e, RecState):
        steps = None if e.steps is None else tuple(fn(a) for a in e.steps)
        return RecState(tuple(fn(a) for a in e.arrays), steps)
    if isinstance(e, QuantKV):
        return QuantKV(fn(e.head_keys), fn(e.head_values), tuple(fn(a) for a in e.keys),
                       tuple(fn(a) for a in e.values))
    if isinstance(e, LayerKV):  # dense, ring and latent entries
        return LayerKV(fn(e.keys), fn(e.values))
    raise TypeError(f"unknown cache entry {type(e).__name__}: no row-axis rule for it")


def _fields(obj: Any, fn: Fn) -> Any:
    """An attrs pytree whose every array field has its rows first (DecodeState,
    SamplingParams, VerifyResult)."""
    changes = {}
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        if isinstance(v, mx.array):
            changes[f.name] = fn(v)
        elif isinstance(v, SamplingParams):
            changes[f.name] = _fields(v, fn)
    return tree_replace(obj, **changes)


def map_rows(tree: Any, fn: Fn) -> Any:
    """Apply `fn` (an operation on axis 0) to every row-first array of `tree`."""
    if isinstance(tree, mx.array):
        return fn(tree)
    if isinstance(tree, KVCache):
        return tree_replace(tree, layers=tuple(_entry(e, fn) for e in tree.layers),
                            lengths=fn(tree.lengths))
    if isinstance(tree, (DecodeState, SamplingParams, VerifyResult)):
        return _fields(tree, fn)
    if tree is None:
        return None
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_rows(x, fn) for x in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_rows(x, fn) for x in tree)
    if isinstance(tree, dict):
        return {k: map_rows(v, fn) for k, v in tree.items()}
    raise TypeError(f"row operations take a KVCache, DecodeState, SamplingParams, VerifyResult, "
                    f"mx.array or a tuple/list/dict of them, got {type(tree).__name__}")


def num_rows(tree: Any) -> int:
    """The number of rows B of a tree (of its first row-first array)."""
    seen: list[int] = []

    def probe(a: mx.array) -> mx.array:
        seen.append(int(a.shape[0]))
        return a

    map_rows(tree, probe)
    if not seen:
        raise ValueError("num_rows: the tree holds no arrays")
    return seen[0]


def take_rows(tree: Any, idx: Int[mx.array, "N"] | Sequence[int]) -> Any:
    """Rows `idx` of every row-first array (a gather: new arrays). idx: int32[N] or a list
    of ints, in [0, B), in any order, repeats allowed: select, reorder (beam search's
    parents), fork (one row into several), drop. A list is checked on the host; an array
    index is not read back (no host sync; out-of-range entries are the caller's bug)."""
    b = num_rows(tree)
    if not isinstance(idx, mx.array):
        ids = [int(i) for i in to_int_array(list(idx), "idx").tolist()] if len(idx) else []
        if not ids:
            raise ValueError("take_rows: idx is empty (a tree needs at least one row)")
        bad = [i for i in ids if not 0 <= i < b]
        if bad:
            raise ValueError(f"take_rows: idx {bad[:4]} outside the tree's rows [0, {b})")
        idx = mx.array(ids, mx.int32)
    idx = to_int_array(idx, "idx")
    if idx.ndim != 1:
        raise ValueError(f"take_rows: idx must be int32[N], got shape {tuple(idx.shape)}")
    return map_rows(tree, lambda a: mx.take(a, idx, axis=0))


def repeat_rows(tree: Any, n: int) -> Any:
    """Each row n times consecutively (row b -> rows b*n .. b*n + n - 1): best-of-n and
    beam search's first expansion from one prefilled prompt."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"repeat_rows: n must be an int >= 1, got {n!r}")
    num_rows(tree)  # a clear error for an unsupported tree
    return map_rows(tree, lambda a: mx.repeat(a, n, axis=0))


def concat_rows(trees: Sequence[Any]) -> Any:
    """The rows of trees[0], then trees[1], ...: trees of one structure (the same static
    fields: a cache's layout and capacity, a state's n_top and sampling features) whose
    arrays agree past the row axis (a state's history width)."""
    trees = list(trees)
    if not trees:
        raise ValueError("concat_rows: no trees")
    if len(trees) == 1:
        return trees[0]
    flat = [tree_flatten(t) for t in trees]
    td = flat[0][1]
    for i, (leaves, other) in enumerate(flat[1:], 1):
        if other != td:
            raise ValueError(f"concat_rows: trees[{i}] has another structure than trees[0] "
                             "(cache layout or capacity, state n_top, sampling features)")
    cols = list(zip(*(leaves for leaves, _ in flat)))
    for col in cols:
        if len({tuple(a.shape[1:]) for a in col}) > 1:
            raise ValueError("concat_rows: arrays differ past the row axis: "
                             f"{[tuple(a.shape) for a in col]}")
    # the row axis of every leaf is axis 0 (checked by map_rows on the first tree)
    num_rows(trees[0])
    return tree_unflatten(td, [mx.concatenate(list(col), axis=0) for col in cols])
