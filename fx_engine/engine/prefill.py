"""`fx_engine.prefill`: the start of a custom decoding loop, bucketed.

    logits, cache, state = fx_engine.prefill(model, [ids_a, ids_b], room=64)

prefills several prompts, one per row, into a fresh cache with room for `room` more
tokens per row, and samples each row's first token. The shapes come from
`core.buckets.prefill_plan` (the capacity and the padded pieces are powers of two), so
another prompt in the same buckets runs the same compiled steps: no recompile per prompt
length, which a cache of exactly `len(ids) + room` positions would cost (the capacity is
part of every step's compile key).

It runs `prefill_step_compiled` piece by piece and evaluates after each (a host loop,
hence in the shell); everything it calls is the pure core's. Where the family packs rows
and no adapters are given, a piece whose rows hold fewer tokens than rows x its size runs
on packed rows (`prefill_step`'s `pack`: the same outputs, no products on padding).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import mlx.core as mx

from fx_engine.core.adapters import Adapters
from fx_engine.core.buckets import prefill_plan
from fx_engine.core.cache import KVCache, init_cache, span_bucket
from fx_engine.core.models import cache_layout, packs_rows
from fx_engine.core.sampling import SamplingConfig
from fx_engine.core.state import DecodeState, init_state
from fx_engine.core.steps import prefill_step_compiled, sample_step_compiled
from fx_engine.core.tree import tree_leaves
from fx_engine.engine.scheduler import pack_arg

__all__ = ["Prefilled", "prefill"]


class Prefilled(NamedTuple):
    """`prefill`'s result: unpack as `logits, cache, state = ...`."""

    logits: mx.array  # float32 [B, V]: each row's logits after its last prompt token
    cache: KVCache  # B rows at lengths len(prompts[b]); capacity >= longest + room
    state: DecodeState  # each row's first token sampled from `logits` (state.tokens)


def _parts(model: Any, headroom: int) -> tuple[Any, tuple, mx.Dtype]:
    """(params, cache layout, cache dtype) of a loaded Model or of a family's params."""
    if hasattr(model, "params") and hasattr(model, "cache_layout"):
        return model.params, model.cache_layout(headroom), model.cache_dtype
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "dtype"):
        raise TypeError(f"prefill: model must be a fx_engine Model or a model's params, got "
                        f"{type(model).__name__}")
    return model, cache_layout(config, headroom=headroom), getattr(mx, model.dtype)


def _check_prompts(prompts: Any, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError("prefill: prompts must be a non-empty list of token-id lists (one per row)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes, int)) or not isinstance(p, Sequence):
            raise TypeError(f"prefill: prompts[{i}] must be a list of token ids, got "
                            f"{type(p).__name__} ([ids] for one row; tokenize text first)")
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prefill: prompts[{i}] is empty (every row needs a token)")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prefill: prompts[{i}] holds a token id outside [0, {vocab})")
        out.append(ids)
    return out


def prefill(
    model: Any, prompts: Sequence[Sequence[int]], room: int = 0, *,
    configs: SamplingConfig | Sequence[SamplingConfig] | None = None, chunk: int = 512,
    headroom: int = 512, adapters: Adapters | None = None, special_token_ids: Sequence[int] = (),
) -> Prefilled:
    """Prefill `prompts` (token ids, one list per row) into a fresh cache with room for
    `room` more tokens per row; returns (logits [B, V], cache, state).

    model: a loaded Model (its KV options apply) or a family's params. configs: sampling
    per row (one SamplingConfig for all; None: greedy) for the first token in `state`.
    chunk: prompt tokens per prefill step (a power of two); headroom: ring slots past a
    sliding window (>= the longest later step - 1; at least `chunk` is used).
    The capacity is a power of two, so it may exceed longest + room: a loop that must stop
    at `room` tokens counts them (a row that reaches the capacity stops, `state.full`).
    """
    params, layout, dtype = _parts(model, max(headroom, chunk))
    vocab = params.config.vocab_size
    prompts = _check_prompts(prompts, vocab)
    lengths = [len(p) for p in prompts]
    capacity, pieces = prefill_plan(lengths, room, chunk)
    cache = init_cache(layout, len(prompts), capacity, dtype)
    ad = {} if adapters is None else {"adapters": adapters}
    packs = adapters is None and packs_rows(params)  # prompts of different lengths: products on their tokens only
    logits = None
    for pos, n, size in pieces:
        tokens = [(p[pos : pos + n] + [0] * size)[:size] for p in prompts]
        counts = [max(0, min(n, length - pos)) for length in lengths]
        pack = pack_arg(sum(counts), size * len(prompts)) if packs else {}
        lg, cache = prefill_step_compiled(
            params, cache, mx.array(tokens, mx.int32), mx.array(counts, mx.int32),
            span=span_bucket(pos + size, capacity), **ad, **pack)
        ends = mx.array([pos < length <= pos + n for length in lengths])  # rows done here
        logits = lg if logits is None else mx.where(ends[:, None], lg, logits)
        mx.eval(logits, *tree_leaves(cache))
    state = init_state(SamplingConfig() if configs is None else configs, prompts, vocab,
                       special_token_ids)
    state = sample_step_compiled(state, logits)
    mx.eval(*tree_leaves(state))
    return Prefilled(logits, cache, state)
