"""Generation entry points.

`stream`/`generate` run on the batching `Engine` (fx_engine.engine.engine) with one row.
`reference_stream`/`reference_generate` are the minimal single-request loop over the pure
steps (chunked prefill, decode, stops) with no scheduler: the independent reference the
engine's tests compare against, and a readable example of driving the steps.

The shell owns the current cache and state and rebinds them after every step (so MLX can
update the KV buffers in place); the compiled steps are pure.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Iterator

import mlx.core as mx
import numpy as np

from fx_engine.core.buckets import max_piece, prefill_pieces
from fx_engine.core.cache import span_bucket
from fx_engine.engine.kv_rows import resize
from fx_engine.loading.model import Model
from fx_engine.core.sampling import SamplingConfig, mask_words
from fx_engine.core.state import init_state
from fx_engine.core.adapters import Adapters
from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled, sample_step_compiled
from fx_engine.core.tree import tree_leaves
from fx_engine.engine.output import TokenOutput
from fx_engine.engine.request import (PREFILL_CHUNK, Completion, TextDelta, Usage, apply_processors, bucket, parse_request, prompt_ids, xtc_special_tokens)
from fx_engine.engine.stops import StopMatcher
from fx_engine.engine.image_prompt import ImagePrompt, has_images, image_prompt, prompt_step_images

MIN_CAPACITY = 256


def stream(model: Model, prompt: Any, **kwargs: Any) -> Iterator[TextDelta]:
    """Generate from `prompt` and yield text deltas as they are decoded.

    Arguments: see `parse_request` (prompt forms, sampling, stop, logprobs,
    logits_processors; the same for `generate` and `Engine.submit`).
    Each delta is a `TextDelta` (a str) with `.token_ids` and `.logprobs`; the last one
    carries `.finish_reason` ("stop" or "length") and `.usage`.
    prompt_cache_dir: a prefix-cache directory (the Engine's disk tier): the prompt's
    longest cached prefix is restored from it, and this prompt and completion are saved.
    """
    return iter(_submit(model, prompt, kwargs))  # validated now; steps run as you iterate


def _image_stream(model: Model, messages: Any, kwargs: dict[str, Any]) -> tuple[list[int], Iterator[TextDelta]]:
    """(prompt ids, deltas) of chat messages with images (`image_prompt`) on the reference
    loop, its prefill chunks holding whole images. Validated and the images encoded now."""
    kwargs = dict(kwargs)
    for key in ("prompt_cache_dir", "draft_model", "prompt_lookup", "prompt_logprobs"):
        if kwargs.get(key) not in (None, False, 0):
            raise ValueError(f"{key} is not supported with images yet")
    if kwargs.get("max_tokens") == 0:
        raise ValueError("max_tokens=0 (scoring a prompt) is not supported with images yet")
    kwargs.pop("chat", None)
    ip = image_prompt(model, messages, chat_template=kwargs.pop("chat_template", None))
    r = parse_request(model, ip.ids, **kwargs)
    grammar = None
    if r.constraint is not None:
        from fx_engine.engine.constraints import RowGrammar, grammar_tokenizer

        grammar = RowGrammar(r.constraint, grammar_tokenizer(
            model.tokenizer, model.config.vocab_size, model.eos_ids))
    return r.ids, _reference_run(model, r.ids, r.sampling, r.max_tokens, r.stops, r.n_top > 0,
                                 r.prefill_chunk, r.processors, grammar, r.adapter, image=ip)


def _submit(model: Model, prompt: Any, kwargs: dict[str, Any]) -> Any:
    """A one-row Engine's handle for this request (its steps run as the caller waits)."""
    from fx_engine.engine.engine import Engine  # engine.py imports this module's types

    kwargs = dict(kwargs)
    cache_dir = kwargs.pop("prompt_cache_dir", None)
    engine = Engine(model, max_rows=1, prefill_chunk=kwargs.get("prefill_chunk", PREFILL_CHUNK),
                    prefix_cache_dir=cache_dir)
    return engine.submit(prompt, **kwargs)



def reference_stream(model: Model, prompt: Any, **kwargs: Any) -> Iterator[TextDelta]:
    """`stream` without the Engine: the plain single-request loop (same arguments)."""
    if has_images(prompt):
        return _image_stream(model, prompt, kwargs)[1]
    r = parse_request(model, prompt, **kwargs)
    if r.prompt_logprobs is not None or r.max_tokens == 0:
        raise ValueError("prompt_logprobs / max_tokens=0: the reference loop does not score "
                         "prompts (use generate, or fx_engine.logits)")
    grammar = None
    if r.constraint is not None:
        from fx_engine.engine.constraints import RowGrammar, grammar_tokenizer

        grammar = RowGrammar(r.constraint, grammar_tokenizer(
            model.tokenizer, model.config.vocab_size, model.eos_ids))
    return _reference_run(model, r.ids, r.sampling, r.max_tokens, r.stops, r.n_top > 0,
                          r.prefill_chunk, r.processors, grammar, r.adapter)


def _reference_run(
    model: Model, ids: list[int], cfg: SamplingConfig, max_tokens: int, stops: StopMatcher,
    want_logprobs: bool, prefill_chunk: int, processors: tuple = (), grammar: Any = None,
    adapter: Any = None, image: ImagePrompt | None = None,
) -> Iterator[TextDelta]:
    tok = model.tokenizer
    # the row's adapter as a step input (slot `adapter.slot` of the model's adapter bank)
    ad = {} if adapter is None else {
        "adapters": Adapters(model.adapters.bank(), mx.array([adapter.slot], mx.int32))}

    def mask() -> mx.array | None:  # the grammar's allowed tokens (None: unconstrained)
        if grammar is None:
            return None
        m = np.full((1, mask_words(c.vocab_size)), -1, np.int32)
        grammar.fill(m[0])
        return mx.array(m)

    params = model.params
    c = model.config

    t0 = time.perf_counter()
    chunk = bucket(min(prefill_chunk, len(ids)))
    # Padding of the last chunk goes to the cache's sink slot: room for the prompt and the
    # first decoded token is enough; decode grows the cache by buckets.
    capacity = bucket(len(ids) + 1, MIN_CAPACITY)
    # images: no chunk cuts an image (its tokens attend to each other), so a chunk may
    # grow past `chunk` to hold one, and the rings need the headroom
    pieces = prefill_pieces(0, len(ids), chunk, image.spans if image is not None else ())
    cache = model.new_cache(1, max(capacity, max_piece(pieces)), headroom=max(chunk, max_piece(pieces)))
    logits = None
    for start, n, size in pieces:
        padded = ids[start : start + n] + [0] * (size - n)
        img = {}
        if image is not None:  # (the step's image rows, and M-RoPE offsets: image_prompt.step_images)
            images = prompt_step_images(image, start, n, model.vision.config.image_token_index)
            img = {} if images is None else {"images": images}
        logits, cache = prefill_step_compiled(
            params, cache, mx.array([padded], mx.int32), mx.array([n], mx.int32),
            span=span_bucket(start + size, cache.capacity), **ad, **img,
        )
        mx.eval(logits, *tree_leaves(cache))
    state = init_state([cfg], [ids], c.vocab_size, special_token_ids=xtc_special_tokens(model))
    state = sample_step_compiled(state, apply_processors(processors, ids, logits), mask())
    mx.eval(tree_leaves(state))
    t1 = time.perf_counter()

    # The per-token output (detokenizing, stops, logprobs, length) is the Engine's own
    # (engine/output.py), so the two report tokens the same way.
    out = TokenOutput(tok, frozenset(model.eos_ids), stops, max_tokens, want_logprobs,
                      cfg.logprobs)
    out.detok = tok.detokenizer()
    generated = out.generated
    gen_time_start = t1
    while True:
        token = int(state.tokens[0].item())
        lp = None
        if want_logprobs:
            lp = out.logprob(token, float(state.logprob[0].item()), state.top_ids[0].tolist(),
                             state.top_logprobs[0].tolist())
        # One delta per token, even when its text is held back (a possible stop-string
        # prefix, an incomplete UTF-8 sequence): token ids are never lost; EOS has none.
        delta, finish = out.add(token, lp)
        if grammar is not None:
            grammar.consume(token)
        if delta is not None:
            yield delta
        if finish is not None:
            break
        # Grow the cache by a bucket when full: one copy per doubling, never per step.
        if len(ids) + len(generated) >= cache.capacity:
            cache = resize(cache, capacity=cache.capacity * 2)
        span = span_bucket(len(ids) + len(generated), cache.capacity)
        if processors:  # forward, the processors (eager), then sampling
            logits, cache = prefill_step_compiled(
                params, cache, state.tokens[:, None], mx.array([1], mx.int32), span=span, **ad)
            logits = apply_processors(processors, ids + generated, logits)
            state = sample_step_compiled(state, logits, mask())
        else:
            state, cache = decode_step_compiled(params, cache, state, span=span, mask=mask(), **ad)
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
        if state.full[0].item():  # no room for the token (the cache grows above): stopped
            finish = "length"
            break
    tail = out.finish(finish)
    t2 = time.perf_counter()
    usage = Usage(
        prompt_tokens=len(ids), completion_tokens=len(generated),
        prompt_seconds=t1 - t0, generation_seconds=t2 - gen_time_start,
    )
    yield out.final_delta(tail, finish, usage)


def _collect(ids: tuple[int, ...], deltas: Iterator[TextDelta], want_logprobs: bool) -> Completion:
    text, tokens, lps = [], [], []
    finish, usage = "length", None
    for d in deltas:
        text.append(d.text)
        tokens.extend(d.token_ids)
        if d.logprobs:
            lps.extend(d.logprobs)
        if d.finish_reason:
            finish, usage = d.finish_reason, d.usage
    return Completion(
        text="".join(text), token_ids=tuple(tokens), finish_reason=finish,
        logprobs=tuple(lps) if want_logprobs else None, usage=usage, prompt_token_ids=ids,
    )


def generate(model: Model, prompt: Any, **kwargs: Any) -> Completion:
    """Generate a whole completion; takes the same arguments as `stream`. Chat messages
    may hold images (engine/image_prompt.py: a multimodal model's)."""
    return _submit(model, prompt, kwargs).result()


def reference_generate(model: Model, prompt: Any, **kwargs: Any) -> Completion:
    """`generate` without the Engine (the reference loop)."""
    if has_images(prompt):
        ids, deltas = _image_stream(model, prompt, kwargs)
        return _collect(tuple(ids), deltas, bool(kwargs.get("logprobs")))
    ids = tuple(prompt_ids(model, prompt, kwargs.get("chat")))
    return _collect(ids, reference_stream(model, prompt, **kwargs), bool(kwargs.get("logprobs")))


# One parameter list (parse_request's), shown by help() and IDEs for all entry points.
stream.__signature__ = inspect.signature(parse_request).replace(  # type: ignore[attr-defined]
    return_annotation=Iterator[TextDelta]
)
generate.__signature__ = inspect.signature(parse_request).replace(  # type: ignore[attr-defined]
    return_annotation=Completion
)
