"""Decoding state: the per-row pytree that `decode_step` consumes and returns."""

from __future__ import annotations

from typing import Sequence

import attrs
import mlx.core as mx
from jaxtyping import Bool, Float, Int, UInt32

from fx_engine.core.sampling import (SamplingConfig, SamplingParams, apply_token_mask, history_width, init_history, init_keys, make_sampling_params, num_top_logprobs, process_logits, push_history, sample, top_logprobs)
from fx_engine.core.tree import static_field, tree_replace


@attrs.frozen
class DecodeState:
    """Per-row decoding state (B rows).

    tokens: the last sampled token of each row (the next decode input).
    keys: per-row PRNG keys; history: recent tokens for the penalties (-1 = empty).
    active: rows that advance; inactive rows keep their token, key, history and length.
    logprob / top_ids / top_logprobs: log-probabilities of the last sampled token and of the
    `n_top` most likely alternatives (mlx-lm semantics: after penalties/bias, before filters).
    """

    tokens: Int[mx.array, "B"]
    keys: UInt32[mx.array, "B 2"]
    history: Int[mx.array, "B W"]
    params: SamplingParams
    active: Bool[mx.array, "B"]
    logprob: Float[mx.array, "B"]
    top_ids: Int[mx.array, "B N"]
    top_logprobs: Float[mx.array, "B N"]
    n_top: int = static_field(default=0)


def sample_step(
    state: DecodeState, logits: Float[mx.array, "B V"], mask: Int[mx.array, "B W"] | None = None
) -> DecodeState:
    """Pure: the allowed-token mask (constrained rows; None: every token allowed), penalties
    and bias, per-row sampling, logprobs; advance active rows only."""
    logits = logits.astype(mx.float32)
    if mask is not None:
        logits = apply_token_mask(logits, mask)
    processed = process_logits(logits, state.history, state.params)
    tokens, logprobs, keys = sample(processed, state.params, state.keys)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_ids, top_vals = top_logprobs(logprobs, state.n_top)
    act = state.active
    col = act[:, None]
    tokens = mx.where(act, tokens, state.tokens)
    return tree_replace(
        state,
        tokens=tokens,
        keys=mx.where(col, keys, state.keys),
        history=mx.where(col, push_history(state.history, tokens), state.history),
        logprob=mx.where(act, chosen, state.logprob),
        top_ids=mx.where(col, top_ids, state.top_ids),
        top_logprobs=mx.where(col, top_vals, state.top_logprobs),
    )


def init_state(
    configs: Sequence[SamplingConfig],
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
) -> DecodeState:
    """Host side: the state for a batch of rows about to sample their first token."""
    b = len(configs)
    n_top = num_top_logprobs(configs)
    return DecodeState(
        tokens=mx.zeros((b,), mx.int32),
        keys=init_keys(configs),
        history=init_history(prompts, history_width(configs)),
        params=make_sampling_params(configs, vocab_size, special_token_ids),
        active=mx.ones((b,), mx.bool_),
        logprob=mx.zeros((b,), mx.float32),
        top_ids=mx.zeros((b, n_top), mx.int32),
        top_logprobs=mx.zeros((b, n_top), mx.float32),
        n_top=n_top,
    )
