"""Requests as the shell sees them: output types, prompt handling, argument validation.

Shared by the reference single-request loop (`engine/generate.py`) and the batching
`Engine` (`engine/engine.py`), so both accept and reject exactly the same arguments.
"""

from __future__ import annotations

import secrets

from typing import Any, Callable, Sequence

import attrs

from fx_engine.core.buckets import pow2_ceil
from fx_engine.loading.model import Model
from fx_engine.core.sampling import SamplingConfig
from fx_engine.engine.image_prompt import has_images
from fx_engine.engine.stops import StopMatcher

PREFILL_CHUNK = 512

# Limits on request parameters whose cost the engine pays per token for every row (a
# request beyond them is a ValueError naming the field; the server answers 400). They are
# far above what any use needs: OpenAI allows 4 stop strings.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_CONTEXT_SIZE = 1 << 20  # repetition/presence/frequency_context_size
MAX_CACHE_SALT_CHARS = 1024


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
    drafted_tokens: int = 0  # speculative decoding: drafts verified by the target
    accepted_tokens: int = 0  # ... of which the target accepted
    draft_rounds: int = 0  # ... in this many verify steps (mean accepted length: 1 + accepted / rounds)
    drafter: str | None = None  # which kind drafted them (`drafter_kind`), None: no speculation

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
    # prompt_logprobs=N: each prompt token's logprob given the tokens before it (None for the
    # first, which has no context) with its N most likely alternatives
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # with logprobs: the record of the end-of-generation token that finished the request
    # (not in token_ids or the text; the completions API reports it, as vLLM does)
    end_logprob: TokenLogprob | None = None
    stop_string: str | None = None  # finish_reason "stop" by this stop string (not EOS)


class TextDelta(str):
    """A streamed text piece (a `str`), carrying the tokens and logprobs it came from.

    `finish_reason` is set on the last delta; `usage` too.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    usage: Usage | None
    end_logprob: TokenLogprob | None  # the last delta: the ending EOS token's record
    stop_string: str | None  # the last delta: the stop string that ended the output

    def __new__(cls, text: str, token_ids=(), logprobs=None, finish_reason=None, usage=None,
                end_logprob=None, stop_string=None):
        obj = super().__new__(cls, text)
        obj.token_ids, obj.logprobs = tuple(token_ids), logprobs
        obj.finish_reason, obj.usage, obj.end_logprob = finish_reason, usage, end_logprob
        obj.stop_string = stop_string
        return obj

    @property
    def text(self) -> str:
        return str.__str__(self)


def bucket(n: int, minimum: int = 16) -> int:
    """The power-of-two shape bucket holding n (so steady state never recompiles)."""
    return pow2_ceil(n, minimum)


def xtc_special_tokens(model: Model) -> list[int]:
    """Tokens XTC never removes: EOS and newline (as mlx-lm's generate and server do)."""
    return sorted(set(model.eos_ids) | set(model.tokenizer.encode("\n", add_special_tokens=False)))


class ContextLengthExceeded(ValueError):
    """A request that cannot fit the context (`context_limit`): a ValueError whose message
    names the limit, carrying the figures a server words its own error with (OpenAI's and
    vLLM's "This model's maximum context length is N tokens...", code
    context_length_exceeded, which clients such as LiteLLM and LangChain recognise).
    prompt_tokens is None for text refused before it was tokenized (`check_prompt_size`)."""

    def __init__(self, message: str, limit: int = 0, prompt_tokens: int | None = None,
                 max_tokens: int = 0):
        super().__init__(message)
        self.limit, self.prompt_tokens, self.max_tokens = limit, prompt_tokens, max_tokens


def context_limit(model: Model) -> tuple[int, str]:
    """The longest sequence a request may reach (`Model.context_length`: the model's
    context, or the smaller cap of `Model.with_max_context`) and how errors name it."""
    own = model.config.max_position_embeddings
    limit = getattr(model, "context_length", own)
    if limit < own:
        return limit, f"the context size of {limit} tokens (max_context, the CLI's --ctx-size; the model's is {own})"
    return limit, f"the model's context of {limit} tokens"


def check_prompt_size(model: Model, nbytes: int, what: str = "prompt") -> None:
    """Reject text that cannot fit the model's context before it is tokenized.

    No token covers more than `tokenizer.max_token_bytes` bytes of text, so text of B bytes
    is at least B / max_token_bytes tokens; anything over twice the bytes the context can
    possibly hold (the factor leaves room for normalizers that shrink text) is refused
    without tokenizing it (a huge prompt would otherwise cost seconds of CPU)."""
    limit, context = context_limit(model)
    most = 2 * model.tokenizer.max_token_bytes * (limit + 1)
    if nbytes > most:
        raise ContextLengthExceeded(
            f"{what}: {nbytes} bytes of text cannot fit {context} "
            f"(at most {most} bytes are accepted)", limit)


def text_bytes(x: Any) -> int:
    """UTF-8 size of the strings in a prompt or a message list (nested content parts)."""
    if isinstance(x, str):
        return len(x.encode("utf-8", "surrogatepass"))
    if isinstance(x, dict):
        return sum(text_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(text_bytes(v) for v in x)
    return 0


def prompt_ids(model: Model, prompt: Any, chat: bool | None = None) -> list[int]:
    """Token ids for a str prompt, a list of token ids, or a list of chat messages."""
    if has_images(prompt):  # (never rendered without its image rows: that would be silently wrong)
        raise ValueError("prompt: chat messages with images go through fx_engine.generate / stream / "
                         "Engine.submit (which encode the images); token ids cannot carry them")
    tok = model.tokenizer
    if isinstance(prompt, (str, list, tuple)) and not (
            prompt and all(isinstance(t, int) for t in prompt)):
        check_prompt_size(model, text_bytes(prompt))
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


@attrs.frozen
class ParsedRequest:
    """A validated request: prompt ids, sampling config, limits, stop matcher."""

    ids: list[int]
    sampling: SamplingConfig
    max_tokens: int
    stops: StopMatcher = attrs.field(eq=False)
    n_top: int
    prefill_chunk: int
    processors: tuple[Callable[[Any, Any], Any], ...] = ()
    drafter: Any = None  # a Drafter (fx_engine.engine.drafters) or None
    num_draft_tokens: int = 0
    cache_salt: str | None = None
    constraint: Any = None
    prompt_logprobs: int | None = None  # a constraints.Constraint (grammar of the output) or None
    adapter: Any = None  # the LoRA adapter (loading.adapters.LoadedAdapter) or None: the base


def apply_processors(
    processors: Sequence[Callable[[Any, Any], Any]], tokens: Sequence[int], logits: Any
) -> Any:
    """Run a request's logits processors (mlx-lm's convention) on one row's logits.

    Each processor is called as `processor(tokens, logits)` with `tokens` an int32
    mx.array of the prompt and every token generated so far, and `logits` float32 [1, V];
    it returns the new logits ([1, V] or [V]). A processor that raises, or returns
    something else, fails its own request only (the engine catches it per row).
    """
    import mlx.core as mx  # the shell may import mlx; kept local so parsing stays light

    if not processors:
        return logits
    v = logits.shape[-1]
    toks = mx.array(list(tokens), mx.int32)
    for i, proc in enumerate(processors):
        out = proc(toks, logits)
        if not isinstance(out, mx.array) or tuple(out.shape) not in ((v,), (1, v)):
            got = getattr(out, "shape", type(out).__name__)
            raise ValueError(f"logits_processors[{i}] must return logits of shape [1, {v}], got {got}")
        logits = out.reshape(1, v).astype(mx.float32)
    return logits


def parse_request(
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
    logits_processors: Sequence[Callable[[Any, Any], Any]] | None = None,
    draft_model: Any = None,
    num_draft_tokens: int | None = None,
    prompt_lookup: Any = False,
    cache_salt: str | None = None,
    response_format: Any = None,
    json_schema: Any = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    constraint: Any = None,
    prompt_logprobs: int | None = None,
    adapter: str | None = None,
) -> ParsedRequest:
    """Validate `generate`/`stream`/`Engine.submit` arguments; ValueError names the field.

    prompt + max_tokens must fit the model's context (+1: the last sampled token is never
    written to the cache).

    prompt: a string (completed as raw text, or as one user message when chat=True), a
    list of token ids, or a list of chat messages ({"role", "content"} dicts; rendered
    with the model's chat template and a generation prompt).
    Sampling parameters follow mlx-lm's sample_utils (temperature 0 = greedy; top_p 1,
    top_k 0, min_p 0, xtc_probability 0 = off). logprobs: N > 0 (or True = 1) reports the
    chosen token's logprob and the N most likely alternatives. stop: strings that end the
    generation; they are never emitted, not even partially.
    logits_processors: callables `processor(tokens, logits) -> logits` as in mlx-lm, run
    eagerly on this request's row before sampling (see `apply_processors`); penalties and
    logit_bias apply after them. A processor that raises fails this request only.
    Speculative decoding (exact: greedy output is unchanged, sampled output has the target's
    distribution): draft_model (a smaller Model with the same tokenizer, any drafter with
    `new_row`, see fx_engine.engine.drafters, or "mtp": the MTP module the model's own
    checkpoint ships, `MtpDrafter.from_model`), or prompt_lookup=True (n-gram drafting from
    the prompt and generated text; or a PromptLookup(ngram_min, ngram_max)); at most
    num_draft_tokens drafts per step (default 4; adapted per row from its acceptance).
    cache_salt: scopes prefix-cache reuse (vLLM's field): a request restores only KV that
    requests with the same salt stored (None: the shared unsalted scope).
    Constrained decoding (at most one; fx_engine/engine/constraints.py): response_format
    (OpenAI's `{"type": "json_object"}` / `{"type": "json_schema", "json_schema": {"name",
    "schema"}}`, or a Pydantic model class), json_schema (a dict or JSON text), regex (the
    whole output matches it), grammar (Lark or llama.cpp GBNF), choice (a list of strings):
    every sampled token is one the grammar allows, also for sampled and speculative rows; the
    output ends when the grammar is complete (the model's end-of-generation token is then
    the only one allowed) or at max_tokens / a stop string. constraint: the same, already
    parsed (`constraints.parse_constraint`, as the server does to name its own fields).
    Scoring: prompt_logprobs=N (0-20) also reports every prompt token's logprob under the
    model (raw log-softmax, before any sampling setting) and its N most likely alternatives
    (vLLM's field; the first token's is None); such a request prefills its whole prompt
    (no prefix-cache restore). max_tokens=0 generates nothing (scoring only).
    adapter: the name of a LoRA / DoRA adapter loaded for this model
    (`fx_engine.load_adapter`); None: the base model. Rows of different adapters share
    the engine's steps; the prefix cache never shares KV between adapters.
    Limits: at most MAX_STOP_STRINGS stop strings of at most MAX_STOP_CHARS characters;
    *_context_size at most MAX_CONTEXT_SIZE (a window longer than the prompt plus
    max_tokens is the same as that length, and costs only that); prompt text that cannot
    fit the context is refused before tokenizing (`check_prompt_size`).
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    if adapter is not None and not isinstance(adapter, str):
        raise ValueError(f"adapter must be None or the name of a loaded adapter, got {type(adapter).__name__}")
    loaded = None if adapter is None else model.adapters.get(adapter)
    if prompt_logprobs is not None and (not isinstance(prompt_logprobs, int) or isinstance(
            prompt_logprobs, bool) or not 0 <= prompt_logprobs <= 20):
        raise ValueError(f"prompt_logprobs must be None or an integer in [0, 20], "
                         f"got {prompt_logprobs!r}")
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if stop is not None and len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, x in enumerate(stop or ()):
        if isinstance(x, str) and len(x) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}]: at most {MAX_STOP_CHARS} characters, got {len(x)}")
    stops = StopMatcher(list(stop or ()))
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                   or len(cache_salt) > MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be None or a non-empty string of at most "
                         f"{MAX_CACHE_SALT_CHARS} characters, got {cache_salt!r:.80}")
    for name, size in (("repetition_context_size", repetition_context_size),
                       ("presence_context_size", presence_context_size),
                       ("frequency_context_size", frequency_context_size)):
        if isinstance(size, int) and not isinstance(size, bool) and size > MAX_CONTEXT_SIZE:
            raise ValueError(f"{name} must be at most {MAX_CONTEXT_SIZE}, got {size}")
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
    ).validate(model.config.vocab_size)
    if cfg.seed is None:  # the pure core draws no entropy: an unseeded request gets a fresh seed
        cfg = attrs.evolve(cfg, seed=secrets.randbits(63))
    ids = prompt_ids(model, prompt, chat)
    if not ids:
        raise ValueError("prompt: encodes to zero tokens")
    limit, context = context_limit(model)
    if len(ids) + max_tokens > limit + 1 and len(ids) > limit:  # no max_tokens >= 1 fits
        raise ContextLengthExceeded(f"prompt ({len(ids)} tokens) alone exceeds {context}",
                                    limit, len(ids), max_tokens)
    if len(ids) + max_tokens > limit + 1:
        raise ContextLengthExceeded(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
            f"exceeds {context}", limit, len(ids), max_tokens)
    cfg = _clamp_windows(cfg, len(ids) + max_tokens)
    procs = () if logits_processors is None else logits_processors
    if callable(procs) or not isinstance(procs, (list, tuple)):
        raise ValueError(
            f"logits_processors must be a list of callables, got {type(procs).__name__}")
    for i, f in enumerate(procs):
        if not callable(f):
            raise ValueError(f"logits_processors[{i}] must be callable, got {type(f).__name__}")
    drafter, k = _parse_speculation(draft_model, num_draft_tokens, prompt_lookup, model)
    if drafter is not None and procs:
        raise ValueError("logits_processors cannot be combined with speculative decoding "
                         "(draft_model / prompt_lookup)")
    from fx_engine.engine.constraints import Constraint, parse_constraint

    given = [x is not None for x in (response_format, json_schema, regex, grammar, choice)]
    if constraint is not None:
        if any(given):
            raise ValueError("constraint: cannot be combined with response_format, json_schema, "
                             "regex, grammar or choice")
        if not isinstance(constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint (constraints.parse_constraint), "
                             f"got {type(constraint).__name__}")
    elif any(given):
        constraint = parse_constraint(response_format, json_schema, regex, grammar, choice)
    return ParsedRequest(ids, cfg, max_tokens, stops, n_top, prefill_chunk, tuple(procs),
                         drafter, k, cache_salt, constraint, prompt_logprobs, loaded)


def _clamp_windows(cfg: SamplingConfig, most: int) -> SamplingConfig:
    """Penalty windows longer than every token the row will ever hold (`most`: prompt +
    max_tokens) see the same tokens as a window of `most`: the same results, and the
    per-row history (and its per-step cost) stays proportional to what can matter."""
    changes = {name: most for name in ("repetition_context_size", "presence_context_size",
                                       "frequency_context_size") if getattr(cfg, name) > most}
    return attrs.evolve(cfg, **changes) if changes else cfg


MAX_DRAFT_TOKENS = 16


def _parse_speculation(draft_model: Any, num_draft_tokens: Any, prompt_lookup: Any,
                       model: Any = None) -> tuple[Any, int]:
    from fx_engine.engine.drafters import PromptLookup, as_drafter

    if draft_model is not None and prompt_lookup not in (False, None):
        raise ValueError("give draft_model or prompt_lookup, not both")
    if isinstance(draft_model, str):
        if draft_model != "mtp":
            raise ValueError(f"draft_model={draft_model!r}: the one name it takes is 'mtp' (the MTP module "
                             "shipped in the model's own checkpoint); a draft model is passed loaded "
                             "(fx_engine.load(path)), a head as a drafter (Eagle3Drafter.load(path, model))")
        from fx_engine.engine.mtp_drafter import mtp_drafter_for

        draft_model = mtp_drafter_for(model)
    drafter = as_drafter(draft_model)
    if prompt_lookup is True:
        drafter = PromptLookup()
    elif isinstance(prompt_lookup, PromptLookup):
        drafter = prompt_lookup
    elif prompt_lookup not in (False, None):
        raise ValueError(f"prompt_lookup must be a bool or a PromptLookup, got {prompt_lookup!r}")
    if num_draft_tokens is None:
        return drafter, (4 if drafter is not None else 0)
    if (not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool)
            or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS):
        raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                         f"got {num_draft_tokens!r}")
    if drafter is None:
        raise ValueError("num_draft_tokens needs draft_model or prompt_lookup")
    return drafter, num_draft_tokens
