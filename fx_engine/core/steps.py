"""The pure step functions users compose, and their compiled forms.

    prefill_step(params, cache, tokens[B, C], n_valid[B]) -> (logits[B, V], cache)
    decode_step(params, cache, state, span=None, mask=None) -> (state, cache)
    sample_step(state, logits[B, V], mask=None) -> state
    score_step(params, cache, tokens[B, T], n_valid[B]) -> (logits[B, T, V], cache)
    hidden_step(params, cache, tokens[B, T], n_valid[B]) -> (hidden[B, T, H], cache)
    verify_step(params, cache, state, drafts[B, K], n_draft[B], draft_probs=None, mask=None)
        -> (state, cache, VerifyResult)              (fx_engine/core/speculative.py)

Every step that runs the model also takes `adapters` (`core.adapters.Adapters`: the
stacked LoRA/DoRA factors and each row's adapter slot; None: the base model only).

Contracts: specs/steps.md. All are pure: same inputs, same outputs; no hidden state. The
`*_compiled` objects are `fx_engine.core.tree.CompiledFunction`s keyed on the full static
structure; their `.trace_log` counts (re)compiles.
"""

from __future__ import annotations

import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.adapters import Adapters, with_adapters
from fx_engine.core.cache import KVCache
from fx_engine.core.models import AnyParams, forward, hidden_to_logits
from fx_engine.core.state import DecodeState, sample_step
from fx_engine.core.tree import CompiledFunction


def prefill_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B C"], n_valid: Int[mx.array, "B"],
    span: int | None = None, adapters: Adapters | None = None,
) -> tuple[Float[mx.array, "B V"], KVCache]:
    """Process a chunk of C tokens per row (rows at any positions; n_valid[b] <= C real
    tokens, the rest padding). Returns logits of each row's last valid token (garbage for
    rows with n_valid == 0, whose length does not move) and the cache with lengths += n_valid.
    span (static): attend over the first `span` cache slots (>= max(lengths) + C).
    """
    params = with_adapters(params, adapters)
    h, cache = forward(params, cache, tokens, n_valid, span)
    last = mx.maximum(n_valid - 1, 0)
    h_last = mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    return hidden_to_logits(params, h_last), cache


def score_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, adapters: Adapters | None = None,
) -> tuple[Float[mx.array, "B T V"], KVCache]:
    """Like prefill_step but returns logits at every position (teacher forcing, verify)."""
    params = with_adapters(params, adapters)
    h, cache = forward(params, cache, tokens, n_valid, span)
    return hidden_to_logits(params, h), cache


def hidden_step(
    params: AnyParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, adapters: Adapters | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Like prefill_step but returns the final-norm hidden states at every position (what
    embedding models pool; no output head)."""
    return forward(with_adapters(params, adapters), cache, tokens, n_valid, span)


def decode_step(
    params: AnyParams, cache: KVCache, state: DecodeState, span: int | None = None,
    mask: Int[mx.array, "B W"] | None = None, adapters: Adapters | None = None,
) -> tuple[DecodeState, KVCache]:
    """One token per active row: forward the last sampled token, sample the next one.
    span (static): attend over the first `span` cache slots (>= max(lengths) + 1).
    mask: allowed-token bitmask per row (`sampling.apply_token_mask`; None: no constraint)."""
    n_valid = state.active.astype(mx.int32)
    params = with_adapters(params, adapters)
    h, cache = forward(params, cache, state.tokens[:, None], n_valid, span)
    logits = hidden_to_logits(params, h[:, 0])
    return sample_step(state, logits, mask), cache


prefill_step_compiled = CompiledFunction(prefill_step, name="prefill_step")
decode_step_compiled = CompiledFunction(decode_step, name="decode_step")
sample_step_compiled = CompiledFunction(sample_step, name="sample_step")
score_step_compiled = CompiledFunction(score_step, name="score_step")
hidden_step_compiled = CompiledFunction(hidden_step, name="hidden_step")

from fx_engine.core.speculative import VerifyResult, verify_step  # noqa: E402  (imports this module's deps)

verify_step_compiled = CompiledFunction(verify_step, name="verify_step")
__all__ = [
    "VerifyResult", "decode_step", "decode_step_compiled", "prefill_step", "prefill_step_compiled",
    "sample_step", "sample_step_compiled", "score_step", "score_step_compiled", "verify_step",
    "hidden_step", "hidden_step_compiled",
    "verify_step_compiled",
]
