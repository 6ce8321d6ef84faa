"""The OpenAI generation routes' shared part (chat.py's /v1/chat/completions and
completions.py's /v1/completions): the sampling fields of their bodies, the engine
arguments those give, and `run`: validate and submit all n choices of a request as a unit,
then answer as JSON or as an SSE stream ending in `data: [DONE]`. Every way out of a request
(an error, a disconnect, the end) frees every row it started.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from jinja2 import TemplateError
from pydantic import ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from fx_engine.engine.engine import EngineClosed, QueueFull
from fx_engine.engine.request import ContextLengthExceeded, context_limit
from fx_engine.server.context import ServerContext, prompt_length
from fx_engine.server.protocol import (EventStream, _Base, _Body, _error, cancel, context_error, failure, speculation,
                                       request_salt, results, room_left, sse)
from fx_engine.server.reasoning import ReasoningStream
from fx_engine.server.reasoning import split as split_reasoning
from fx_engine.server.tools import ToolCallStream, chat_delta, parse_tool_calls


class StreamOptions(_Base):
    model_config = ConfigDict(extra="forbid")  # a misspelt option is a 400, not a no-op
    include_usage: bool = False
    # OpenAI's padding of stream events; not implemented on this route: only false
    include_obfuscation: Literal[False] | None = None


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's seed is a signed 64-bit integer; -1 means "random" (llama.cpp's server)
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16)
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    # fx-engine's field: false runs this request without the server's speculative decoding
    # (the same output, at plain decoding's speed)
    speculative_decoding: bool | None = None
    # vLLM's field: this request reuses (and leaves) prefix-cache entries only among
    # requests with the same salt (and API key)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Identifiers for the provider's own bookkeeping (OpenAI): they change no output; `user`
    # and `safety_identifier` go to the access log, prefix caching is always on.
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    # OpenAI's retention hint: the prefix cache keeps entries while its budget allows, either way
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # Constrained decoding (fx_engine/engine/constraints.py), at most one of: OpenAI's
    # response_format; vLLM's guided_* fields and structured_outputs; llama.cpp's grammar
    # (GBNF or Lark) and json_schema.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


_STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
               "choice": "choice", "json_object": "response_format"}


def _constraint(r: _Sampling) -> Any:
    """The request's output constraint (constraints.Constraint or None) from whichever
    spelling it used; two at once, or a bad grammar, is a ValueError naming the fields."""
    fields: dict[str, tuple[str, Any]] = {}  # engine argument -> (field name, value)

    def put(arg: str, name: str, value: Any) -> None:
        if value is None:
            return
        if fields:
            other = next(iter(fields.values()))[0]
            raise ValueError(f"{name}: cannot be combined with {other} (give one output constraint)")
        fields[arg] = (name, value)

    put("response_format", "response_format", r.response_format)
    put("json_schema", "guided_json", r.guided_json)
    put("regex", "guided_regex", r.guided_regex)
    put("grammar", "guided_grammar", r.guided_grammar)
    put("choice", "guided_choice", r.guided_choice)
    put("grammar", "grammar", r.grammar)
    put("json_schema", "json_schema", r.json_schema)
    for key, value in (r.structured_outputs or {}).items():
        if key not in _STRUCTURED:
            raise ValueError(f"structured_outputs.{key}: unknown or unsupported field "
                             f"(supported: {', '.join(_STRUCTURED)})")
        if key == "json_object":
            if value is not True:
                continue
            value = {"type": "json_object"}
        put(_STRUCTURED[key], f"structured_outputs.{key}", value)
    if not fields:
        return None
    from fx_engine.engine.constraints import parse_constraint

    return parse_constraint(**{a: v for a, (_, v) in fields.items()},
                            names={a: n for a, (n, _) in fields.items()})


def _engine_seed(seed: int | None) -> int | None:
    """The engine's seed (in [0, 2**64)) for a request's signed 64-bit one: -1 is no seed (a
    fresh random one, as llama.cpp's server reads it); other negatives wrap, as the same
    64 bits read unsigned, so each still names one reproducible stream."""
    return None if seed is None or seed == -1 else seed % 2**64


def _sampling_kwargs(r: _Sampling, defaults: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    constraint = _constraint(r)
    if constraint is not None:
        kw["constraint"] = constraint
    mt = next((v for v in (r.max_completion_tokens, r.max_tokens) if v is not None),
              defaults.get("max_tokens", 512))
    kw["max_tokens"] = mt
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "repetition_context_size", "seed", "xtc_probability",
                 "xtc_threshold"):
        v = getattr(r, name) if name != "seed" else _engine_seed(r.seed)
        if v is None:
            v = defaults.get(name)
        if v is not None:
            kw[name] = v
    if r.logit_bias:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in r.logit_bias.items()}
        except ValueError as e:
            raise ValueError(f"logit_bias: keys must be token ids ({e})") from None
    stop = r.stop if r.stop is not None else defaults.get("stop")  # (serve --stop)
    if stop is not None:
        kw["stop"] = stop
    speculation(kw, defaults, r.speculative_decoding)
    return kw


def _usage(completions: list[Any], prompt_tokens: int) -> dict[str, Any]:
    gen = sum(c.usage.completion_tokens for c in completions)
    cached = max((c.usage.cached_tokens for c in completions), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": gen,
            "total_tokens": prompt_tokens + gen,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finish(reason: str | None) -> str | None:
    return {"cancelled": "stop"}.get(reason, reason) if reason else None


def _chat_logprobs(lps: Any, top: int = 20) -> dict[str, Any] | None:
    if lps is None:
        return None
    return {"content": [{
        "token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                         for _, t, v in lp.top[:top]],
    } for lp in lps]}


def _completion_logprobs(lps: Any, prompt_lps: Any = None, top: int = 20,
                         offset: int = 0, first: str = "") -> dict[str, Any] | None:
    """The completions API's logprobs: parallel lists over the (echoed prompt and)
    generated tokens; an echoed prompt's first token (text `first`) has null logprobs (no
    context). text_offset: each token's character offset in the returned text."""
    if lps is None and prompt_lps is None:
        return None
    recs = list(prompt_lps or ()) + list(lps or ())
    tokens, offsets, at = [], [], offset
    for i, lp in enumerate(recs):
        text = lp.token if lp is not None else first
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in recs],
            "top_logprobs": [None if lp is None else {t: v for _, t, v in lp.top[:top]}
                             for lp in recs],
            "text_offset": offsets}


def _choices(body: _Sampling, kw: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the n choices' arguments: choice i > 0 draws with seed + i."""
    out = []
    for i in range(body.n):
        k = dict(kw)
        if i and "seed" in k and isinstance(k["seed"], int):
            k["seed"] = (k["seed"] + i) % 2**64
        out.append(k)
    return out


async def run(ctx: ServerContext, request: Request, body: _Sampling, build: Any, chat: bool,
              tool_names: set[str] | None = None, echoes: list[str] | None = None):
    """Prepare (template, tokenize, validate: `build` on a worker thread) and submit
    all n choices as a unit, then answer (JSON or SSE). Every path out cancels what
    it started."""
    bad = ctx.unknown_model(body.model)
    if bad is not None:
        return bad

    # no max_tokens in the request: the server's default, trimmed to the room the context
    # leaves (as vLLM's default is); one the client chose that does not fit is a 400
    default_length = body.max_tokens is None and body.max_completion_tokens is None
    limit = context_limit(ctx.model)[0]  # the model's, or serve's --max-kv-size

    def prepare() -> list[Any]:
        built = build()  # one (prompt, kwargs), or a list of them (a list of prompts)
        handles: list[Any] = []
        try:
            for prompt, kw in (built if isinstance(built, list) else [built]):
                if default_length and kw.get("max_tokens"):  # (0: scoring, nothing to trim)
                    kw["max_tokens"] = room_left(kw["max_tokens"], prompt_length(prompt), limit)
                kw["cache_salt"] = request_salt(request, body.cache_salt)
                kw["adapter"] = ctx.adapter_of(body.model)
                handles += ctx.engine.submit_many(prompt, _choices(body, kw))
        except BaseException:
            cancel(handles)  # a later prompt failed: the earlier ones never run
            raise
        return handles

    try:
        handles = await run_in_threadpool(prepare)
    except QueueFull as e:  # rows free up within seconds: ask the client to retry soon
        return _error(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"})
    except EngineClosed as e:
        return _error(503, str(e), kind="server_error", headers={"Retry-After": "5"})
    except TemplateError as e:  # the model's template rejects these messages (raise_exception)
        return _error(400, f"messages: the chat template failed: {e}", "messages")
    except ContextLengthExceeded as e:
        return context_error(e, ctx.model, "messages" if chat else "prompt")
    except ValueError as e:
        msg = str(e)
        param = msg.split(" ")[0].split(":")[0] if msg else None
        return _error(400, msg, param)
    except Exception as e:  # a template that fails to render these messages
        if not chat:
            raise
        return _error(400, f"messages: the chat template failed: {e}", "messages")

    ctx.metrics.requests += len(handles)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    # each prompt counts once, whatever its number of choices (as OpenAI counts)
    prompt_tokens = sum(len(h.prompt_token_ids) for h in handles[:: body.n])
    obj = "chat.completion" if chat else "text_completion"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(
            _stream(ctx, request, handles, rid, created, chat, include_usage, prompt_tokens,
                    getattr(body, "top_logprobs", None) or 0, tool_names,
                    getattr(body, "parallel_tool_calls", None) is False, echoes,
                    getattr(body, "logprobs", None) if not chat else None,
                    shown=ctx.shown_model(body.model)),
            media_type="text/event-stream",
            background=BackgroundTask(cancel, handles))  # also if the body never started
    try:
        outs = await results(request, handles)
    except Exception as e:  # the request failed inside the engine (a grammar, a processor)
        status, msg, param = failure(e)
        return _error(status, msg, param, kind="server_error" if status >= 500 else
                      "invalid_request_error")
    finally:
        cancel(handles)
    if outs is None:
        return _error(499, "client disconnected", kind="cancelled")
    for o in outs:
        ctx.metrics.observe(o)
    choices = []
    for i, o in enumerate(outs):
        if chat:
            reasoning, text = split_reasoning(ctx.think_fmt, o.text, ctx.in_reasoning(o.prompt_token_ids))
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if ctx.think_fmt is not None:  # the thinking, apart (vLLM's field)
                message["reasoning_content"] = reasoning or None
            finish = _finish(o.finish_reason)
            if tool_names is not None:
                content, calls = parse_tool_calls(text, tool_names)
                if getattr(body, "parallel_tool_calls", None) is False:
                    calls = calls[:1]  # the client asked for at most one call
                if calls:
                    message.update(content=content if content.strip() else None, tool_calls=calls)
                    finish = "tool_calls" if finish == "stop" else finish
            c = {"index": i, "message": message, "finish_reason": finish,
                 "logprobs": _chat_logprobs(o.logprobs, getattr(body, "top_logprobs", None) or 0)}
        else:
            echoed = echoes[i // body.n] if echoes else ""
            lps = None
            if getattr(body, "logprobs", None) is not None:
                # the ending EOS token is reported too (not in the text), as vLLM does:
                # lm-eval's scoring reads the prompt's logprobs as all but the last
                end = (o.end_logprob,) if o.end_logprob is not None else ()
                lps = _completion_logprobs((*(o.logprobs or ()), *end),
                                           o.prompt_logprobs if echoes else None, body.logprobs,
                                           first=ctx.tokenizer.decode(o.prompt_token_ids[:1]))
            c = {"index": i, "text": echoed + o.text, "finish_reason": _finish(o.finish_reason),
                 "logprobs": lps}
        choices.append(c)
    return {"id": rid, "object": obj, "created": created, "model": ctx.shown_model(body.model),
            "choices": choices, "usage": _usage(outs, prompt_tokens),
            "system_fingerprint": ctx.model.fingerprint}


async def _stream(ctx: ServerContext, request: Request, handles: list[Any], rid: str, created: int,
                  chat: bool, include_usage: bool, prompt_tokens: int, top_n: int = 0,
                  tool_names: set[str] | None = None, one_call: bool = False,
                  echoes: list[str] | None = None, n_logprobs: int | None = None,
                  *, shown: str):
    obj = "chat.completion.chunk" if chat else "text_completion"
    n_choices = len(handles) // len(echoes) if echoes else 1
    echo_due = [bool(echoes)] * len(handles)  # the prompt goes first, with its logprobs
    offsets = [0] * len(handles)  # text_offset: where each choice's next token starts
    tool_streams = ([ToolCallStream(tool_names, 1 if one_call else None) for _ in handles]
                    if tool_names is not None else None)
    thinking = [ReasoningStream(ctx.think_fmt, ctx.in_reasoning(h.prompt_token_ids)) for h in handles]
    # Bounded: a client that reads slower than the engine generates falls behind by
    # at most `backlog` events; beyond that it is cut off and its rows freed (the
    # engine itself never waits for a socket).
    backlog = ctx.settings.stream_buffer * len(handles)
    queue: asyncio.Queue = asyncio.Queue()
    cut_off = asyncio.Event()

    async def pump(i: int, h: Any) -> None:
        try:
            async for ev in h.aiter():
                if queue.qsize() >= backlog:
                    cut_off.set()
                    cancel(handles)
                    return
                queue.put_nowait((i, ev, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    live = len(handles)
    usage_done = []
    t_last = [time.perf_counter()] * len(handles)
    first = [True] * len(handles)
    try:
        if chat:
            for i in range(len(handles)):
                yield sse({"id": rid, "object": obj, "created": created, "model": shown,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None, "logprobs": None}]})
        while live:
            if cut_off.is_set():
                yield sse({"error": {
                    "message": f"stream cut off: the client fell more than {backlog} "
                               "events behind", "type": "server_error", "param": None,
                    "code": "client_too_slow"}})
                return
            if await request.is_disconnected():
                break
            try:
                i, ev, err = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                continue
            if ev is None:
                if err is not None:
                    status, msg, param = failure(err)
                    yield sse({"error": {"message": msg, "param": param, "code": None,
                                          "type": "server_error" if status >= 500
                                          else "invalid_request_error"}})
                live -= 1
                continue
            now = time.perf_counter()
            if ev.token_ids:
                if first[i]:
                    ctx.metrics.ttft.observe(now - handles[i].timings.get("submitted", now))
                    first[i] = False
                else:
                    ctx.metrics.itl.observe(now - t_last[i])
                t_last[i] = now
            if ev.usage is not None:
                usage_done.append(ev.usage)
                ctx.metrics.count_tokens(ev.usage)
            if echo_due[i]:
                echo_due[i] = False
                plp = handles[i].prompt_logprobs if n_logprobs is not None else None
                offsets[i] = len(echoes[i // n_choices])
                yield sse({"id": rid, "object": obj, "created": created, "model": shown,
                            "choices": [{"index": i, "text": echoes[i // n_choices],
                                         "finish_reason": None,
                                         "logprobs": _completion_logprobs(
                                             None, plp, n_logprobs, first=ctx.tokenizer.decode(
                                                 handles[i].prompt_token_ids[:1]))
                                         if plp is not None else None}]})
            if not ev.text and not ev.finish_reason:
                continue
            if chat:
                finish = _finish(ev.finish_reason)
                reasoning, text = thinking[i].feed(ev.text)
                if ev.finish_reason:
                    r2, t2 = thinking[i].finish()
                    reasoning, text = reasoning + r2, text + t2
                delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
                if tool_streams is not None:  # calls stream as they are written
                    pieces = tool_streams[i].feed(text)
                    if ev.finish_reason:
                        more, calls = tool_streams[i].finish()
                        pieces += more
                        if calls:
                            finish = "tool_calls" if finish == "stop" else finish
                    text, tool_deltas = chat_delta(pieces)
                    if tool_deltas:
                        delta["tool_calls"] = tool_deltas
                if text:
                    delta = {"content": text, **delta}
                if not delta and not finish and not ev.logprobs:
                    continue
                choice = {"index": i, "delta": delta, "finish_reason": finish,
                          "logprobs": _chat_logprobs(ev.logprobs, top_n)}
            else:
                choice = {"index": i, "text": ev.text, "finish_reason": _finish(ev.finish_reason),
                          "logprobs": None if n_logprobs is None else _completion_logprobs(
                              (*(ev.logprobs or ()), *((ev.end_logprob,) if getattr(
                                  ev, "end_logprob", None) is not None else ())),
                              None, n_logprobs, offset=offsets[i])}
                offsets[i] += sum(len(lp.token) for lp in ev.logprobs or ())
            chunk = {"id": rid, "object": obj, "created": created, "model": shown,
                     "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        else:
            if include_usage:
                gen = sum(u.completion_tokens for u in usage_done)
                yield sse({"id": rid, "object": obj, "created": created, "model": shown,
                            "choices": [], "usage": {
                                "prompt_tokens": prompt_tokens, "completion_tokens": gen,
                                "total_tokens": prompt_tokens + gen,
                                "prompt_tokens_details": {"cached_tokens": max(
                                    (u.cached_tokens for u in usage_done), default=0)}}})
            yield "data: [DONE]\n\n"
    finally:  # disconnected (or the generator closed): free the rows now
        cancel(handles)
        for t in tasks:
            t.cancel()

