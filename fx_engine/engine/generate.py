"""Single-request generation in the shell: tokenize, chunked prefill, decode loop, stops.

The shell owns the current cache and state and rebinds them after every step (so MLX can
update the KV buffers in place); the compiled steps are pure. Batched, multi-request
serving builds on the same steps (fx_engine.engine.scheduler, issue 3).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Iterator, Sequence

import attrs
import mlx.core as mx

from ..cache import init_cache, resize, span_bucket
from ..model import Model
from ..sampling import SamplingConfig
from ..state import init_state
from ..steps import decode_step_compiled, prefill_step_compiled, sample_step_compiled
from ..tree import tree_leaves, tree_replace
from .stops import StopMatcher

PREFILL_CHUNK = 512
MIN_CAPACITY = 256


@attrs.frozen
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        n = self.completion_tokens
        return n / self.generation_seconds if self.generation_seconds > 0 else 0.0


@attrs.frozen
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    logprobs: tuple[TokenLogprob, ...] | None
    usage: Usage
    prompt_token_ids: tuple[int, ...] = ()


class TextDelta(str):
    """A streamed text piece (a `str`), carrying the tokens and logprobs it came from.

    `finish_reason` is set on the last delta; `usage` too.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    usage: Usage | None

    def __new__(cls, text: str, token_ids=(), logprobs=None, finish_reason=None, usage=None):
        obj = super().__new__(cls, text)
        obj.token_ids, obj.logprobs = tuple(token_ids), logprobs
        obj.finish_reason, obj.usage = finish_reason, usage
        return obj

    @property
    def text(self) -> str:
        return str.__str__(self)


def bucket(n: int, minimum: int = 16) -> int:
    """The power-of-two shape bucket holding n (so steady state never recompiles)."""
    return max(minimum, 1 << max(0, (n - 1)).bit_length())


def xtc_special_tokens(model: Model) -> list[int]:
    """Tokens XTC never removes: EOS and newline (as mlx-lm's generate and server do)."""
    return sorted(set(model.eos_ids) | set(model.tokenizer.encode("\n", add_special_tokens=False)))


def prompt_ids(model: Model, prompt: Any, chat: bool | None = None) -> list[int]:
    """Token ids for a str prompt, a list of token ids, or a list of chat messages."""
    tok = model.tokenizer
    if isinstance(prompt, str):
        if chat:
            return list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True))
        return list(tok.encode(prompt))
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} outside [0, {model.config.vocab_size})")
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return list(tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True))
    raise ValueError(
        "prompt: expected a non-empty string, a list of token ids, or a list of chat "
        f"messages (dicts with 'role' and 'content'); got {type(prompt).__name__}"
    )


def stream(
    model: Model,
    prompt: Any,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop: Sequence[str] | str | None = None,
    seed: int | None = None,
    logprobs: int | bool = 0,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    presence_penalty: float = 0.0,
    presence_context_size: int = 20,
    frequency_penalty: float = 0.0,
    frequency_context_size: int = 20,
    logit_bias: dict[int, float] | None = None,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    chat: bool | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
) -> Iterator[TextDelta]:
    """Generate from `prompt` and yield text deltas as they are decoded.

    prompt: a string (completed as raw text, or as one user message when chat=True), a
    list of token ids, or a list of chat messages ({"role", "content"} dicts; rendered
    with the model's chat template and a generation prompt).
    Sampling parameters follow mlx-lm's sample_utils (temperature 0 = greedy; top_p 1,
    top_k 0, min_p 0, xtc_probability 0 = off). logprobs: N > 0 (or True = 1) reports the
    chosen token's logprob and the N most likely alternatives. stop: strings that end the
    generation; they are never emitted, not even partially.

    Each delta is a `TextDelta` (a str) with `.token_ids` and `.logprobs`; the last one
    carries `.finish_reason` ("stop" or "length") and `.usage`.
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    stops = StopMatcher(list(stop or ()))
    if isinstance(logprobs, bool):
        n_top = int(logprobs)
    elif isinstance(logprobs, int) and 0 <= logprobs <= 20:
        n_top = logprobs
    else:
        raise ValueError(f"logprobs must be a bool or an integer in [0, 20], got {logprobs!r}")
    cfg = SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, presence_context_size=presence_context_size,
        frequency_penalty=frequency_penalty, frequency_context_size=frequency_context_size,
        logit_bias=logit_bias, seed=seed, logprobs=n_top,
    )
    want_logprobs = n_top > 0
    ids = prompt_ids(model, prompt, chat)
    if not ids:
        raise ValueError("prompt: encodes to zero tokens")
    limit = model.config.max_position_embeddings
    if len(ids) > limit:
        raise ValueError(f"prompt: {len(ids)} tokens exceeds the model's context of {limit} tokens")
    # The last sampled token is never written to the cache: a full context still yields one.
    max_tokens = min(max_tokens, limit - len(ids) + 1)
    # Validation above runs at call time; generation runs lazily as the caller iterates.
    return _run(model, ids, cfg, max_tokens, stops, want_logprobs, prefill_chunk)


def _run(
    model: Model, ids: list[int], cfg: SamplingConfig, max_tokens: int, stops: StopMatcher,
    want_logprobs: bool, prefill_chunk: int,
) -> Iterator[TextDelta]:
    tok = model.tokenizer
    eos = set(model.eos_ids)
    params = model.params
    c = model.config
    dtype = getattr(mx, params.dtype)

    t0 = time.perf_counter()
    chunk = bucket(min(prefill_chunk, len(ids)))
    # Padding of the last chunk goes to the cache's sink slot: room for the prompt and the
    # first decoded token is enough; decode grows the cache by buckets.
    capacity = bucket(len(ids) + 1, MIN_CAPACITY)
    cache = init_cache(c.num_layers, 1, c.num_kv_heads, capacity, c.head_dim, dtype)
    logits = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        size = chunk if len(piece) == chunk else bucket(len(piece))
        padded = piece + [0] * (size - len(piece))
        logits, cache = prefill_step_compiled(
            params, cache, mx.array([padded], mx.int32), mx.array([len(piece)], mx.int32),
            span=span_bucket(start + size, cache.capacity),
        )
        mx.eval(logits, *tree_leaves(cache))
    state = init_state([cfg], [ids], c.vocab_size, special_token_ids=xtc_special_tokens(model))
    state = sample_step_compiled(state, logits)
    mx.eval(tree_leaves(state))
    t1 = time.perf_counter()

    detok = tok.detokenizer()
    known = tok.vocab_size  # models may pad their vocabulary past the tokenizer's
    piece = lambda i: tok.decode([i]) if i < known else ""  # noqa: E731
    generated: list[int] = []
    finish = "length"
    gen_time_start = t1
    while True:
        token = int(state.tokens[0].item())
        lp = None
        if want_logprobs:
            top = tuple(
                (int(i), piece(int(i)), float(v))
                for i, v in zip(state.top_ids[0].tolist(), state.top_logprobs[0].tolist())
            )
            lp = (TokenLogprob(token, piece(token), float(state.logprob[0].item()), top),)
        if token in eos:
            finish = "stop"
            break
        generated.append(token)
        text = stops.feed(detok.add(token) if token < known else "")
        done_len = len(generated) >= max_tokens
        if stops.stopped:
            finish = "stop"
        # One delta per token, even when its text is held back (a possible stop-string
        # prefix, an incomplete UTF-8 sequence): token ids are never lost.
        yield TextDelta(text, (token,), lp)
        if stops.stopped or done_len:
            break
        # Grow the cache by a bucket when full: one copy per doubling, never per step.
        if len(ids) + len(generated) >= cache.capacity:
            cache = resize(cache, capacity=cache.capacity * 2)
        span = span_bucket(len(ids) + len(generated), cache.capacity)
        state, cache = decode_step_compiled(params, cache, state, span=span)
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
    tail = "" if stops.stopped else stops.feed(detok.finalize())
    tail += stops.flush()
    t2 = time.perf_counter()
    usage = Usage(
        prompt_tokens=len(ids), completion_tokens=len(generated),
        prompt_seconds=t1 - t0, generation_seconds=t2 - gen_time_start,
    )
    yield TextDelta(tail, (), None, finish, usage)


def generate(model: Model, prompt: Any, **kwargs: Any) -> Completion:
    """Generate a whole completion; takes the same arguments as `stream`."""
    ids = prompt_ids(model, prompt, kwargs.get("chat"))
    text, tokens, lps = [], [], []
    finish, usage = "length", None
    for d in stream(model, prompt, **kwargs):
        text.append(d.text)
        tokens.extend(d.token_ids)
        if d.logprobs:
            lps.extend(d.logprobs)
        if d.finish_reason:
            finish, usage = d.finish_reason, d.usage
    return Completion(
        text="".join(text), token_ids=tuple(tokens), finish_reason=finish,
        logprobs=tuple(lps) if kwargs.get("logprobs") else None, usage=usage,
        prompt_token_ids=tuple(ids),
    )


generate.__signature__ = inspect.signature(stream).replace(  # type: ignore[attr-defined]
    return_annotation=Completion
)
