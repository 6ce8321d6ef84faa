"""The OpenAI-compatible HTTP server (FastAPI) on the continuous-batching Engine.

    app = create_app(engine, model_id="smollm2")      # engine started by the caller
    uvicorn.run(app, host="127.0.0.1", port=8080)

Endpoints: POST /v1/chat/completions, POST /v1/completions (JSON or SSE streaming with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text). Every request
is a row of the shared Engine (many clients stream at once); a client that disconnects
cancels its rows. Bad input is an HTTP 400 with an OpenAI-style JSON error body naming the
field; a full queue is a 429; a missing or wrong API key (when one is set) a 401.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.engine import Engine, EngineClosed, QueueFull
from .metrics import Metrics
from .tools import ToolCallStream, parse_tool_calls, template_messages


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, ...)


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
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
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=16)
    xtc_probability: float | None = None
    xtc_threshold: float | None = None


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Base):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # mlx_lm.server's per-request variables


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None):
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": None}})


def _content(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for p in m.content:  # OpenAI content parts: text only
        if p.get("type") != "text":
            raise ValueError(f"messages: content part type {p.get('type')!r} is not supported (text only)")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


def _sampling_kwargs(r: _Sampling, defaults: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    mt = r.max_completion_tokens or r.max_tokens or defaults.get("max_tokens", 512)
    kw["max_tokens"] = mt
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "repetition_context_size", "seed", "xtc_probability",
                 "xtc_threshold"):
        v = getattr(r, name)
        if v is None:
            v = defaults.get(name)
        if v is not None:
            kw[name] = v
    if r.logit_bias:
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in r.logit_bias.items()}
        except ValueError as e:
            raise ValueError(f"logit_bias: keys must be token ids ({e})") from None
    if r.stop is not None:
        kw["stop"] = r.stop
    for name in ("draft_model", "num_draft_tokens", "prompt_lookup"):
        if defaults.get(name) is not None:
            kw[name] = defaults[name]
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


def _completion_logprobs(lps: Any) -> dict[str, Any] | None:
    if lps is None:
        return None
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t: v for _, t, v in lp.top} for lp in lps]}


def create_app(engine: Engine, model_id: str, api_key: str | None = None,
               defaults: dict[str, Any] | None = None, chat_template: str | None = None,
               chat_template_args: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app over a started `engine`. `defaults`: server-wide sampling defaults
    (the CLI's --temp, --top-p, --max-tokens, ...) and speculative decoding settings.
    chat_template / chat_template_args: a Jinja template replacing the model's, and extra
    variables for it (e.g. {"enable_thinking": false}), as mlx_lm.server's flags."""
    app = FastAPI(title="fx-engine", version="0.1.0")
    metrics = Metrics(engine)
    defaults = dict(defaults or {})
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else
                      str(first.get("msg", "invalid request")), loc or None)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(401, "missing or invalid API key", kind="authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model",
                                            "created": int(time.time()), "owned_by": "fx-engine"}]}

    @app.get("/metrics")
    async def prom() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def run(request: Request, body: _Sampling, prompt: Any, kw: dict[str, Any], chat: bool,
                  tool_names: set[str] | None = None):
        n = body.n
        try:
            handles = [engine.submit(prompt, **{**kw, **({"seed": kw["seed"] + i} if "seed" in kw and i else {})})
                       for i in range(n)]
        except QueueFull as e:  # rows free up within seconds: ask the client to retry soon
            return _error(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"})
        except EngineClosed as e:
            return _error(503, str(e), kind="server_error", headers={"Retry-After": "5"})
        except ValueError as e:
            msg = str(e)
            param = msg.split(" ")[0].split(":")[0] if msg else None
            return _error(400, msg, param)
        except TemplateError as e:  # the model's template rejects these messages (raise_exception)
            return _error(400, f"messages: the chat template failed: {e}", "messages")
        metrics.requests += n
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        prompt_tokens = len(handles[0].prompt_token_ids)
        obj = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(request, handles, rid, created, chat, include_usage, prompt_tokens,
                        getattr(body, "top_logprobs", None) or 0, tool_names),
                media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*[_result(request, h) for h in handles])
        except asyncio.CancelledError:
            for h in handles:
                h.cancel()
            raise
        except Exception as e:  # the request failed inside the engine (e.g. a processor)
            return _error(500, f"generation failed: {e!r}", kind="server_error")
        if any(o is None for o in outs):
            return _error(499, "client disconnected", kind="cancelled")
        for o in outs:
            metrics.observe(o)
        choices = []
        for i, o in enumerate(outs):
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": o.text}
                finish = _finish(o.finish_reason)
                if tool_names is not None:
                    content, calls = parse_tool_calls(o.text, tool_names)
                    if calls:
                        message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                        finish = "tool_calls" if finish == "stop" else finish
                c = {"index": i, "message": message, "finish_reason": finish,
                     "logprobs": _chat_logprobs(o.logprobs, getattr(body, "top_logprobs", None) or 0)}
            else:
                text = (body.prompt if isinstance(body.prompt, str) and body.echo else "") + o.text
                c = {"index": i, "text": text, "finish_reason": _finish(o.finish_reason),
                     "logprobs": _completion_logprobs(o.logprobs)}
            choices.append(c)
        return {"id": rid, "object": obj, "created": created, "model": model_id,
                "choices": choices, "usage": _usage(outs, prompt_tokens),
                "system_fingerprint": engine.model.fingerprint}

    async def _result(request: Request, h: Any) -> Any:
        """Wait for a handle, cancelling it if the client goes away."""
        while not h.done:
            if await request.is_disconnected():
                h.cancel()
                return None
            await asyncio.sleep(0.02)
        return h.result()

    async def _stream(request: Request, handles: list[Any], rid: str, created: int, chat: bool,
                      include_usage: bool, prompt_tokens: int, top_n: int = 0,
                      tool_names: set[str] | None = None):
        obj = "chat.completion.chunk" if chat else "text_completion"
        tool_streams = [ToolCallStream(tool_names) for _ in handles] if tool_names is not None else None
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, h: Any) -> None:
            try:
                async for ev in h.aiter():
                    await queue.put((i, ev, None))
            except Exception as e:
                await queue.put((i, None, e))
            await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        live = len(handles)
        usage_done = []
        t_last = [time.perf_counter()] * len(handles)
        first = [True] * len(handles)
        try:
            if chat:
                for i in range(len(handles)):
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model_id,
                                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None, "logprobs": None}]})
            while live:
                if await request.is_disconnected():
                    break
                try:
                    i, ev, err = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    continue
                if ev is None:
                    if err is not None:
                        yield _sse({"error": {"message": f"generation failed: {err!r}",
                                              "type": "server_error"}})
                    live -= 1
                    continue
                now = time.perf_counter()
                if ev.token_ids:
                    if first[i]:
                        metrics.ttft.observe(now - handles[i].timings.get("submitted", now))
                        first[i] = False
                    else:
                        metrics.itl.observe(now - t_last[i])
                    t_last[i] = now
                if ev.usage is not None:
                    usage_done.append(ev.usage)
                    metrics.count_tokens(ev.usage)
                if not ev.text and not ev.finish_reason:
                    continue
                if chat:
                    text, finish = ev.text, _finish(ev.finish_reason)
                    delta: dict[str, Any] = {}
                    if tool_streams is not None:
                        text = tool_streams[i].feed(ev.text)
                        if ev.finish_reason:
                            rest, calls = tool_streams[i].finish()
                            text += rest
                            if calls:
                                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                                finish = "tool_calls" if finish == "stop" else finish
                    if text:
                        delta = {"content": text, **delta}
                    if not delta and not finish and not ev.logprobs:
                        continue
                    choice = {"index": i, "delta": delta, "finish_reason": finish,
                              "logprobs": _chat_logprobs(ev.logprobs, top_n)}
                else:
                    choice = {"index": i, "text": ev.text, "finish_reason": _finish(ev.finish_reason),
                              "logprobs": _completion_logprobs(ev.logprobs)}
                chunk = {"id": rid, "object": obj, "created": created, "model": model_id,
                         "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            else:
                if include_usage:
                    gen = sum(u.completion_tokens for u in usage_done)
                    yield _sse({"id": rid, "object": obj, "created": created, "model": model_id,
                                "choices": [], "usage": {
                                    "prompt_tokens": prompt_tokens, "completion_tokens": gen,
                                    "total_tokens": prompt_tokens + gen,
                                    "prompt_tokens_details": {"cached_tokens": max(
                                        (u.cached_tokens for u in usage_done), default=0)}}})
                yield "data: [DONE]\n\n"
        finally:  # disconnected (or the generator closed): free the rows now
            for h in handles:
                if not h.done:
                    h.cancel()
            for t in tasks:
                t.cancel()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        use_tools = bool(body.tools) and body.tool_choice != "none"
        try:
            messages = []
            for m in body.messages:
                msg: dict[str, Any] = {"role": m.role if m.role != "developer" else "system",
                                       "content": _content(m)}
                for extra in ("name", "tool_calls", "tool_call_id"):
                    if getattr(m, extra) is not None:
                        msg[extra] = getattr(m, extra)
                messages.append(msg)
            messages = template_messages(messages)
            kw = _sampling_kwargs(body, defaults)
            prompt: Any = messages
            targs = {**(chat_template_args or {}), **(body.chat_template_kwargs or {})}
            if chat_template is not None or targs or use_tools:
                tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
                prompt = list(engine.model.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, tools=tools,
                    chat_template=chat_template, **targs))
        except ValueError as e:
            return _error(400, str(e), "messages" if "messages" in str(e) else None)
        except Exception as e:  # a template that fails to render these messages
            return _error(400, f"messages: the chat template failed: {e}", "messages")
        if body.logprobs:  # the engine reports the chosen token with >= 1 alternative
            kw["logprobs"] = max(1, body.top_logprobs or 0)
        elif body.top_logprobs:
            return _error(400, "top_logprobs: requires logprobs: true", "top_logprobs")
        names = {t.function.name for t in body.tools} if use_tools else None
        return await run(request, body, prompt, kw, chat=True, tool_names=names)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        try:
            kw = _sampling_kwargs(body, defaults)
        except ValueError as e:
            return _error(400, str(e))
        if body.logprobs:
            kw["logprobs"] = body.logprobs
        prompt = body.prompt
        if isinstance(prompt, str) and not prompt:
            return _error(400, "prompt: must not be empty", "prompt")
        return await run(request, body, prompt, kw, chat=False)

    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
