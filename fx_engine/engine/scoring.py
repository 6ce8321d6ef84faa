"""Teacher-forced logits (perplexity, parity checks): a thin shell over `score_step`."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from fx_engine.core.adapters import Adapters
from fx_engine.core.cache import span_bucket
from fx_engine.core.buckets import pow2_ceil, prefill_pieces
from fx_engine.loading.model import Model
from fx_engine.core.steps import hidden_step_compiled, score_step_compiled
from fx_engine.core.tree import tree_leaves


def logits(model: Model, token_ids: Sequence[int], chunk: int = 512, adapter: str | None = None) -> mx.array:
    """Logits [T, V] (float32) of every position of `token_ids`, computed in chunks.
    adapter: a loaded LoRA adapter's name (`fx_engine.load_adapter`); None: the base."""
    ad = {}
    if adapter is not None:
        ad = {"adapters": Adapters(model.adapters.bank(), mx.array([model.adapters.get(adapter).slot], mx.int32))}
    ids = checked_ids(model, token_ids)
    size = pow2_ceil(min(chunk, len(ids)), 16)
    cache = model.new_cache(1, pow2_ceil(len(ids) + size, 256), headroom=size)
    out = []
    for start, n, padded_size in prefill_pieces(0, len(ids), size):
        padded = ids[start : start + n] + [0] * (padded_size - n)
        lg, cache = score_step_compiled(
            model.params, cache, mx.array([padded], mx.int32), mx.array([n], mx.int32),
            span=span_bucket(start + padded_size, cache.capacity), **ad,
        )
        lg = lg[0, :n]
        mx.eval(lg, *tree_leaves(cache))
        out.append(lg)
    return mx.concatenate(out, axis=0)


def hidden_states(model: Model, token_ids: Sequence[int], layers: Sequence[int], chunk: int = 512) -> mx.array:
    """The residual stream at layer boundaries for every position of `token_ids`
    [T, len(layers) * hidden] (float32), captured inside the compiled prefill steps
    (`core.models.Capture`): boundary b < num_layers is the stream entering layer b (0: the
    embeddings as the first layer reads them), b == num_layers the stream after the last
    layer, before the final norm. What EAGLE-3 heads read (`core.drafters.eagle3.aux_layers`)
    and what tools/train_drafter.py trains on."""
    from fx_engine.core.models import Capture

    ids = checked_ids(model, token_ids)
    capture = Capture(tuple(layers))
    size = pow2_ceil(min(chunk, len(ids)), 16)
    cache = model.new_cache(1, pow2_ceil(len(ids) + size, 256), headroom=size)
    out = []
    for start, n, padded_size in prefill_pieces(0, len(ids), size):
        padded = ids[start : start + n] + [0] * (padded_size - n)
        _, cache, captured = hidden_step_compiled(
            model.params, cache, mx.array([padded], mx.int32), mx.array([n], mx.int32),
            span=span_bucket(start + padded_size, cache.capacity), capture=capture,
        )
        captured = captured[0, :n].astype(mx.float32)
        mx.eval(captured, *tree_leaves(cache))
        out.append(captured)
    return mx.concatenate(out, axis=0)


def checked_ids(model: Model, token_ids: Sequence[int]) -> list[int]:
    """token_ids as a list, refused when empty or holding a non-id (the error names it)."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("token_ids: must not be empty")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < model.config.vocab_size]
    if bad:
        raise ValueError(f"token_ids: {bad[0]!r} is not a token id in [0, {model.config.vocab_size})")
    return ids
