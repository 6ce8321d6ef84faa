"""The pure step functions users compose, and their compiled forms.

    prefill_step(params, cache, tokens[B, C], n_valid[B]) -> (logits[B, V], cache)
    logits_step(params, cache, tokens[B] | [B, T], n_valid=None) -> (logits[B, V] | [B, T, V], cache)
    decode_step(params, cache, state, span=None, mask=None, pack=None) -> (state, cache)
    sample_step(state, logits[B, V], mask=None) -> state
    score_step(params, cache, tokens[B, T], n_valid[B]) -> (logits[B, T, V], cache)
    hidden_step(params, cache, tokens[B, T], n_valid[B]) -> (hidden[B, T, H], cache)
    (prefill_step, score_step, hidden_step, decode_step and verify_step also take `pack`:
    their products on the valid tokens alone, core/packing.py)
    verify_step(params, cache, state, drafts[B, K], n_draft[B], draft_probs=None, mask=None)
        -> (state, cache, VerifyResult)              (fx_engine/core/speculative.py)

Every step that runs the model also takes `adapters` (`core.adapters.Adapters`: the
stacked LoRA/DoRA factors and each row's adapter slot; None: the base model only), and
`capture` (`core.models.Capture`: hidden states at chosen layer boundaries; None: none):
with a capture, the step returns one more value at the end, the captured states of every
position it processed [B, T, points * H] from the same forward (a prefill's whole chunk, a
decode's one position, a verify's K + 1), garbage past each row's valid tokens. That is the
seam learned drafters (EAGLE-3, MTP) read the target through.

Inputs are checked when a step is traced (core/checks.py: ranks, rows, dtypes, a chunk
longer than the capacity), so a wrong one fails with the argument's name and expected
shape; token ids and counts may be Python lists / ints. Nothing is ever silently wrong
past the capacity: a forward step returns NaN at every position whose token did not fit
(its length stops at the capacity), and decode/verify steps stop a row that has no room
(`DecodeState.full`).

Contracts: specs/steps.md. All are pure: same inputs, same outputs; no hidden state. The
`*_compiled` objects are `fx_engine.core.tree.CompiledFunction`s keyed on the full static
structure; their `.trace_log` counts (re)compiles.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from jaxtyping import Bool, Float, Int

from fx_engine.core import packing
from fx_engine.core.adapters import Adapters, with_adapters
from fx_engine.core.cache import CacheError, KVCache, check_cache
from fx_engine.core.checks import convert_args, counts_arg, span_arg, to_int_array, tokens_arg
from fx_engine.core.models import AnyParams, Capture, forward, hidden_to_logits
from fx_engine.core.state import DecodeState, check_state, sample_step, stop_full_rows
from fx_engine.core.tree import CompiledFunction


def step_inputs(
    cache: Any, tokens: Any, n_valid: Any, span: Any,
) -> tuple[KVCache, Int[mx.array, "B T"], Int[mx.array, "B"], int | None]:
    """A forward step's inputs, checked (and lists / ints converted): the chunk must fit in
    the cache at all (T <= capacity: a longer one could only be cut), tokens and n_valid
    must have the cache's rows."""
    cache = check_cache(cache)
    tokens = tokens_arg(tokens, cache.rows)
    t = tokens.shape[1]
    if t > cache.capacity:
        raise CacheError(f"tokens has {t} tokens per row but the cache holds {cache.capacity} "
                         "positions per row: the chunk cannot fit (use a larger cache, e.g. "
                         "fx_engine.prefill(model, prompts, room=...), or shorter chunks)")
    n_valid = counts_arg(n_valid, cache.rows)
    return cache, tokens, n_valid, span_arg(span, t, cache.capacity)


def past_capacity(cache: KVCache, n_valid: Int[mx.array, "B"], t: int) -> Bool[mx.array, "B T"]:
    """Valid tokens whose positions lie at or past the capacity (the step drops them)."""
    offs = mx.arange(t, dtype=mx.int32)[None, :]
    return (offs < n_valid[:, None]) & (cache.lengths[:, None] + offs >= cache.capacity)


def not_fitted(cut: Bool[mx.array, "B T"], n_valid: Int[mx.array, "B"], pack: int | None) -> Bool[mx.array, "B T"]:
    """`cut` and the valid tokens that did not fit in `pack` packed rows (the step drops
    them too: core/packing.py)."""
    if pack is None:
        return cut
    offs = mx.arange(cut.shape[1], dtype=mx.int32)[None, :]
    return cut | ((offs < n_valid[:, None]) & (offs >= packing.fitted(n_valid, pack)[:, None]))


def run_forward(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None, capture: Capture | None, images: Any = None, pack: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache, mx.array | None]:
    """The model's forward as every step runs it: (hidden, cache, captured or None).
    images: the step's image rows (`vision.gemma3.ImageInput`; None: text only).
    pack: its row-wise work on this many packed rows (core/packing.py; None: B*T)."""
    out = forward(params, cache, tokens, n_valid, span, capture, images=images, pack=pack)
    return (out[0], out[1], out[2] if capture is not None else None)


def with_captured(out: tuple, captured: mx.array | None) -> tuple:
    """A step's outputs, and its captured states last when it captured."""
    return out if captured is None else (*out, captured)


def mark_cut(h: Float[mx.array, "B T H"], cut: Bool[mx.array, "B T"]) -> Float[mx.array, "B T H"]:
    """NaN hidden states where a token did not fit: every logit computed from them is NaN
    (the row's length stopped at the capacity), so an overflow is visible, never silent."""
    return mx.where(cut[..., None], mx.array(math.nan, h.dtype), h)


def prefill_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B C"], n_valid: Int[mx.array, "B"],
    span: int | None = None, adapters: Adapters | None = None, capture: Capture | None = None,
    images: Any = None, pack: int | None = None,
) -> tuple[Float[mx.array, "B V"], KVCache]:
    """Process a chunk of C tokens per row (rows at any positions; n_valid[b] <= C real
    tokens, the rest padding). Returns logits of each row's last valid token (garbage for
    rows with n_valid == 0, whose length does not move) and the cache with lengths += n_valid.
    span (static): attend over the first `span` cache slots (>= max(lengths) + C).
    A row whose last valid token lies past the capacity gets NaN logits.
    images: the chunk's image rows (`core.vision.gemma3.ImageInput`; Gemma 3): spliced at
    the image tokens, each image's tokens attending to the whole image; the chunk must hold
    whole image runs. None: text only (the graph is unchanged).
    pack (static): the projections and MLPs run on this many rows holding the chunk's valid
    tokens, row after row, not on all B*C (core/packing.py: the same outputs, less work
    where rows are padded; at least sum(n_valid): a row's tokens past it are dropped like
    tokens past the capacity, its logits NaN). None: all B*C. Families whose layers read
    the padded layout refuse it (ValueError), as do steps with images or adapters.
    """
    cache, tokens, n_valid, span = step_inputs(cache, tokens, n_valid, span)
    pack = packing.check_pack(pack, adapters)
    cut = not_fitted(past_capacity(cache, n_valid, tokens.shape[1]), n_valid, pack)
    params = with_adapters(params, adapters)
    h, cache, captured = run_forward(params, cache, tokens, n_valid, span, capture, images, pack)
    last = mx.maximum(n_valid - 1, 0)[:, None]
    h_last = mx.take_along_axis(h, last[:, :, None], axis=1)  # [B, 1, H]
    h_last = mark_cut(h_last, mx.take_along_axis(cut, last, axis=1))[:, 0]
    return with_captured((hidden_to_logits(params, h_last), cache), captured)


def logits_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B"] | Int[mx.array, "B T"],
    n_valid: Int[mx.array, "B"] | int | None = None, span: int | None = None,
    adapters: Adapters | None = None, capture: Capture | None = None, images: Any = None,
) -> tuple[Float[mx.array, "B V"] | Float[mx.array, "B T V"], KVCache]:
    """The forward alone: feed new tokens and return their logits (float32), no sampling.

    tokens int32[B]: one token per row (a decode position; beam search, guidance, entropy)
    -> logits [B, V]. tokens int32[B, T]: T per row -> logits at every position [B, T, V].
    n_valid: real tokens per row (default all of them; `state.active` works: 0 leaves a row
    untouched, its logits meaningless). Positions whose token did not fit in the cache are
    NaN. span (static): as for the other steps. images: as for prefill_step.
    """
    cache = check_cache(cache)
    tokens = to_int_array(tokens, "tokens")
    one = tokens.ndim == 1
    if one:
        if tokens.shape[0] != cache.rows:
            raise ValueError(f"tokens int32[B] (one token per row) has {tokens.shape[0]} entries "
                             f"but the cache has {cache.rows} rows; T tokens of one row: [ids]")
        tokens = tokens[:, None]
    if n_valid is None:  # every token is real
        n_valid = tokens.shape[1] if tokens.ndim == 2 else 1
    cache, tokens, n_valid, span = step_inputs(cache, tokens, n_valid, span)
    cut = past_capacity(cache, n_valid, tokens.shape[1])
    params = with_adapters(params, adapters)
    h, cache, captured = run_forward(params, cache, tokens, n_valid, span, capture, images)
    logits = hidden_to_logits(params, mark_cut(h, cut))
    return with_captured(((logits[:, 0] if one else logits), cache), captured)


def score_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, adapters: Adapters | None = None, capture: Capture | None = None,
    images: Any = None, pack: int | None = None,
) -> tuple[Float[mx.array, "B T V"], KVCache]:
    """Like prefill_step but returns logits at every position (teacher forcing, verify);
    NaN at positions whose token did not fit in the cache (or in `pack`). images, pack: as
    for prefill_step."""
    cache, tokens, n_valid, span = step_inputs(cache, tokens, n_valid, span)
    pack = packing.check_pack(pack, adapters)
    cut = not_fitted(past_capacity(cache, n_valid, tokens.shape[1]), n_valid, pack)
    params = with_adapters(params, adapters)
    h, cache, captured = run_forward(params, cache, tokens, n_valid, span, capture, images, pack)
    return with_captured((hidden_to_logits(params, mark_cut(h, cut)), cache), captured)


def hidden_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, adapters: Adapters | None = None, capture: Capture | None = None,
    images: Any = None, pack: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Like prefill_step but returns the final-norm hidden states at every position (what
    embedding models pool; no output head); NaN where a token did not fit. images, pack: as
    for prefill_step."""
    cache, tokens, n_valid, span = step_inputs(cache, tokens, n_valid, span)
    pack = packing.check_pack(pack, adapters)
    cut = not_fitted(past_capacity(cache, n_valid, tokens.shape[1]), n_valid, pack)
    h, cache, captured = run_forward(with_adapters(params, adapters), cache, tokens, n_valid, span, capture,
                                     images, pack)
    return with_captured((mark_cut(h, cut), cache), captured)


def decode_step(
    params: AnyParams, cache: KVCache, state: DecodeState, span: int | None = None,
    mask: Int[mx.array, "B W"] | None = None, adapters: Adapters | None = None,
    capture: Capture | None = None, pack: int | None = None,
) -> tuple[DecodeState, KVCache]:
    """One token per active row: forward the last sampled token, sample the next one.
    span (static): attend over the first `span` cache slots (>= max(lengths) + 1).
    mask: allowed-token bitmask per row (`sampling.apply_token_mask`; None: no constraint).
    An active row whose cache is full (length == capacity) cannot take its token: it stops
    (inactive, `state.full` set; finish_reason "length") and is otherwise untouched.
    pack (static): the products, the output head included, run on this many rows holding
    the active rows' tokens (core/packing.py; a batch with free rows: no work on them),
    the same outputs. It must hold the active rows: an active row past it is not run, its
    logits are NaN, so it stops as a full row does. None: every row."""
    cache = check_cache(cache)
    state = check_state(state, cache.rows)
    span = span_arg(span, 1, cache.capacity)
    pack = packing.check_pack(pack, adapters)
    state = stop_full_rows(state, cache.lengths, cache.capacity, 1)
    n_valid = state.active.astype(mx.int32)
    params = with_adapters(params, adapters)
    h, cache, captured = run_forward(params, cache, state.tokens[:, None], n_valid, span, capture, pack=pack)
    logits = packed_logits(params, h[:, 0], n_valid, pack)
    return with_captured((sample_step(state, logits, mask), cache), captured)


def packed_logits(params: AnyParams, h: Float[mx.array, "B H"], n_valid: Int[mx.array, "B"],
                  pack: int | None) -> Float[mx.array, "B V"]:
    """The output head on one position per row; packed (`pack` rows): on the rows with a
    token alone (`packing.on_packed`), NaN for a row whose token did not fit."""
    if pack is None:
        return hidden_to_logits(params, h)
    fit = packing.fitted(n_valid, pack)
    logits = packing.on_packed(lambda x: hidden_to_logits(params, x), h, fit, 1, pack)
    return mark_cut(logits[:, None], ((n_valid > 0) & (fit == 0))[:, None])[:, 0]


# Token ids and counts given as lists / ints become arrays before the compiled forms
# flatten their arguments (else each list would be a compile-time constant).
_FORWARD_ARGS = convert_args({2: "tokens", 3: "n_valid"})
prefill_step_compiled = CompiledFunction(prefill_step, name="prefill_step", prepare=_FORWARD_ARGS)
logits_step_compiled = CompiledFunction(logits_step, name="logits_step", prepare=_FORWARD_ARGS)
decode_step_compiled = CompiledFunction(decode_step, name="decode_step")
sample_step_compiled = CompiledFunction(sample_step, name="sample_step")
score_step_compiled = CompiledFunction(score_step, name="score_step", prepare=_FORWARD_ARGS)
hidden_step_compiled = CompiledFunction(hidden_step, name="hidden_step", prepare=_FORWARD_ARGS)

from fx_engine.core.speculative import VerifyResult, verify_step  # noqa: E402  (imports this module's deps)

verify_step_compiled = CompiledFunction(verify_step, name="verify_step",
                                        prepare=convert_args({3: "drafts", 4: "n_draft"}))
__all__ = [
    "VerifyResult", "decode_step", "decode_step_compiled", "prefill_step", "prefill_step_compiled",
    "logits_step", "logits_step_compiled",
    "sample_step", "sample_step_compiled", "score_step", "score_step_compiled", "verify_step",
    "hidden_step", "hidden_step_compiled",
    "verify_step_compiled",
]
