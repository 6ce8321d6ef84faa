"""Decoding state: the per-row pytree that `decode_step` consumes and returns."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
from jaxtyping import Bool, Float, Int, UInt32

from fx_engine.core.sampling import (SamplingConfig, SamplingParams, apply_token_mask, history_width, init_history, init_keys, make_sampling_params, num_top_logprobs, process_logits, push_history, sample, top_logprobs)
from fx_engine.core.checks import float_arg, mask_arg
from fx_engine.core.tree import static_field, tree_replace


@attrs.frozen
class DecodeState:
    """Per-row decoding state (B rows).

    tokens: the last sampled token of each row (the next decode input).
    keys: per-row PRNG keys; history: recent tokens for the penalties (-1 = empty).
    active: rows that advance; inactive rows keep their token, key, history and length.
    A step leaves `tokens[b]` new exactly when row b is active after it.
    logprob / top_ids / top_logprobs: log-probabilities of the last sampled token and of the
    `n_top` most likely alternatives (mlx-lm semantics: after penalties/bias, before filters).
    full: rows that stopped because their next token did not fit in the cache (a decode or
    verify step found `lengths[b] == capacity`, or `sample_step` got NaN logits for the
    row: what the forward steps return for a token past the capacity). Such a row is made
    inactive by that step: finish_reason "length". Read it after the step; no host sync
    happens inside. `init_state` clears it; nothing sets it back.
    """

    tokens: Int[mx.array, "B"]
    keys: UInt32[mx.array, "B 2"]
    history: Int[mx.array, "B W"]
    params: SamplingParams
    active: Bool[mx.array, "B"]
    logprob: Float[mx.array, "B"]
    top_ids: Int[mx.array, "B N"]
    top_logprobs: Float[mx.array, "B N"]
    full: Bool[mx.array, "B"]
    n_top: int = static_field(default=0)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


def check_state(state: Any, rows: int | None = None, name: str = "state") -> DecodeState:
    """Trace-time check that `state` is a DecodeState whose every array has the same rows
    (and `rows` of them when given: the cache's), with the shapes the fields promise."""
    if not isinstance(state, DecodeState):
        raise TypeError(f"{name} must be a DecodeState (fx_engine.init_state), got {type(state).__name__}")
    b = state.tokens.shape[0] if state.tokens.ndim == 1 else None
    if b is None:
        raise ValueError(f"{name}.tokens must be int32[B], got shape {tuple(state.tokens.shape)}")
    expect = {"keys": (b, 2), "active": (b,), "full": (b,), "logprob": (b,),
              "history": (b, None), "top_ids": (b, state.n_top), "top_logprobs": (b, state.n_top)}
    for field, shape in expect.items():
        got = tuple(getattr(state, field).shape)
        if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
            want = ", ".join("W" if s is None else str(s) for s in shape)
            raise ValueError(f"{name}.{field} must have shape [{want}] ({b} rows), got {got}")
    if state.params.batch_size != b:
        raise ValueError(f"{name}.params holds {state.params.batch_size} rows but {name} has {b}")
    if rows is not None and b != rows:
        raise ValueError(f"{name} has {b} rows but the cache has {rows}: a state and its cache "
                         "need the same rows (fx_engine.take_rows / repeat_rows reshape both)")
    return state


def sample_step(
    state: DecodeState, logits: Float[mx.array, "B V"], mask: Int[mx.array, "B W"] | None = None
) -> DecodeState:
    """Pure: the allowed-token mask (constrained rows; None: every token allowed), penalties
    and bias, per-row sampling, logprobs; advance active rows only. A row whose logits hold
    a NaN (a forward step's mark of a token past the cache's capacity) stops: inactive,
    `full` set, its token unchanged."""
    b = check_state(state).rows
    logits = float_arg(logits, (b, None), "logits", f"f32[B, V] (B = {b}, the state's rows)")
    logits = logits.astype(mx.float32)
    if mask is not None:
        logits = apply_token_mask(logits, mask_arg(mask, (b,), logits.shape[-1]))
    bad = mx.any(mx.isnan(logits), axis=-1)
    processed = process_logits(logits, state.history, state.params)
    tokens, logprobs, keys = sample(processed, state.params, state.keys)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_ids, top_vals = top_logprobs(logprobs, state.n_top)
    act = state.active & ~bad
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
        active=act,
        full=state.full | (state.active & bad),
    )


def stop_full_rows(state: DecodeState, lengths: Int[mx.array, "B"], capacity: int,
                   need: int) -> DecodeState:
    """Active rows without room for `need` more positions stop, flagged `full` (before a
    step's forward, so their token is not written to the sink and lost)."""
    room = lengths + need <= capacity
    return tree_replace(state, active=state.active & room, full=state.full | (state.active & ~room))


def stop_rows(state: DecodeState, done: Bool[mx.array, "B"]) -> DecodeState:
    """The state with rows `done` made inactive (e.g. after a stop token): later steps leave
    them as they are."""
    return tree_replace(state, active=state.active & ~done)


def init_state(
    configs: SamplingConfig | Sequence[SamplingConfig],
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
) -> DecodeState:
    """Host side: the state for a batch of rows about to sample their first token: one
    SamplingConfig per row (or one for every row) and each row's prompt ids (the penalty
    history)."""
    configs, prompts = _check_rows(configs, prompts)
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
        full=mx.zeros((b,), mx.bool_),
        n_top=n_top,
    )


def _check_rows(configs: Any, prompts: Any) -> tuple[list[SamplingConfig], list[Sequence[int]]]:
    """init_state's rows: as many configs as prompts (a single config applies to all)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"prompts must be a list of token-id lists (one per row), got {type(prompts).__name__}")
    prompts = list(prompts)
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise TypeError(f"prompts[{i}] must be a list of token ids, got {type(p).__name__}; "
                            "prompts holds one list per row ([ids] for one row)")
    if isinstance(configs, SamplingConfig):
        configs = [configs] * len(prompts)
    configs = list(configs)
    if not prompts:
        raise ValueError("init_state needs at least one row (prompts is empty)")
    if len(configs) != len(prompts):
        raise ValueError(f"init_state: {len(configs)} configs for {len(prompts)} prompts; give "
                         "one SamplingConfig per row (or one for every row)")
    return configs, prompts
