"""The OpenAI-compatible HTTP server (FastAPI) on the continuous-batching Engine.

    app = create_app(engine, model_id="smollm2")      # engine started by the caller
    uvicorn.Server(server_config(app, host="127.0.0.1", port=8080)).run()

(`server_config`: fx_engine/server/connections.py, the connection limits: request-head
and keep-alive timeouts, a connection limit, the kernel's view of what a client left
unread. Plain `uvicorn.run(app)` works too, without them.)

Endpoints: POST /v1/chat/completions, POST /v1/completions (JSON or SSE streaming with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text). Every request
is a row of the shared Engine (many clients stream at once).

Robustness (what one client can do to the others):
* A request is validated whole (all its `n` choices) before any part of it starts; a
  request that fails, is rejected or whose client disconnects (streaming or not) frees
  every row it started within a step.
* The engine never waits on a client: each streamed request has a bounded buffer
  (`stream_buffer` events per choice); a client that falls that far behind is cut off
  (an error event, if it ever reads again) and its rows are freed. Served with
  `server_config`, a stream is also cut off (its connection dropped, its rows freed) when
  its client reads nothing while more than `stream_unread_bytes` wait for it in the
  server's and the kernel's send buffers, or for `send_timeout` seconds.
* Request bodies are bounded (`max_request_bytes`, 413), prompt text that cannot fit the
  context is refused before tokenizing (400), and templating and tokenization run on worker
  threads (the tokenizer releases the GIL on long texts), so /health stays responsive.
* With API keys (one per tenant), every route but /health needs one (401), and each key
  has its own prefix-cache scope (a request's `cache_salt` narrows it further): tenants
  never share cached KV, so neither `cached_tokens` nor the time to first token reveal
  another tenant's prompts. Without keys the cache is shared by all clients (use
  `cache_salt` to opt out).
* Every error is an OpenAI-shaped JSON body (`{"error": {"message", "type", "param",
  "code"}}`): 400 for bad input naming the field (invalid text such as lone UTF-16
  surrogates included), 401, 404, 405, 413, 429 with Retry-After when the queue is full,
  503 after shutdown, 500 only for a fault of the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from typing import Any, Literal, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from fx_engine.engine.engine import Engine, EngineClosed, QueueFull
from fx_engine.engine.grammar_guard import GrammarError, check_schema
from fx_engine.engine.request import check_prompt_size, prompt_ids, text_bytes
from fx_engine.server.fields import check_fields
from fx_engine.server.reasoning import ReasoningStream, reasoning_format, starts_in_reasoning, template_switches
from fx_engine.server.reasoning import split as split_reasoning
from fx_engine.server.metrics import Metrics
from fx_engine.server.tools import (ToolCallStream, chat_delta, parse_tool_calls, render_tools_in_prompt, template_messages, tool_call_grammar, tool_format)

#: The server's logger: one access line per request (INFO), every 4xx (WARNING) and 5xx
#: (ERROR) with its reason; `fx-engine serve --log-level` sets the level.
log = logging.getLogger("fx_engine.server")

MAX_REQUEST_BYTES = 4 << 20  # request bodies beyond this are refused (413) unread
STREAM_BUFFER = 256  # events per choice a streaming client may fall behind before cut-off
OPEN_PATHS = frozenset({"/health"})  # answered without an API key
SEND_TIMEOUT = 30.0  # seconds a client's socket may accept nothing before it is closed
BODY_TIMEOUT = 30.0  # seconds a request body may take to arrive whole (408 beyond)
STREAM_UNREAD_BYTES = 64 << 10  # bytes a stream's client may leave unread while not reading


def _bad_text(x: Any, path: str = "") -> str | None:
    """The path of the first string in a decoded JSON body that is not valid Unicode text
    (a lone UTF-16 surrogate, which JSON's \\uD800 escapes can produce), else None.
    Cheap on big bodies: ASCII strings are known valid in O(1), numbers are skipped, and
    a path is only built for the container that holds the bad string."""
    if type(x) is str:
        if x.isascii():
            return None
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if type(x) is list and not {str, dict, list} & set(map(type, x)):  # numbers: C speed
        return None
    items = x.items() if type(x) is dict else enumerate(x) if type(x) is list else ()
    for k, v in items:
        if type(k) is str and _bad_text(k) is not None:
            return path or "body"
        if type(v) in (str, dict, list):
            bad = _bad_text(v, f"{path}.{k}" if path else str(k))
            if bad is not None:
                return bad
    return None


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, ...)


class _Body(_Base):
    """A request body: valid text everywhere; every top-level field known (server/fields.py:
    an unknown or unimplemented field is a 400 naming it, never silently dropped)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        bad = _bad_text(data, "")
        if bad:
            raise ValueError(f"{bad}: invalid text (a lone UTF-16 surrogate is not a character)")
        check_fields(data, cls.model_fields)
        return data


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


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """A text part's text is a string (not rendered as the repr of whatever came)."""
        for i, part in enumerate(v if isinstance(v, list) else ()):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part needs a string `text`")
        return v


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
    # a template switch (gpt-oss's reasoning_effort; enable_thinking elsewhere); see reasoning.py
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None, code: str | None = None):
    log.log(logging.ERROR if status >= 500 else logging.WARNING, "%d %s: %s", status, kind,
            message[:500])
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


# Arguments of the chat template the server passes itself (the request's own fields): a
# chat_template_kwargs entry of the same name is a 400 on every route.
_SERVER_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "chat_template",
                                   "template", "special_tokens"})


def _openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template gets them (OpenAI's developer role is a system one)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role if m.role != "developer" else "system",
                               "content": _content(m)}
        for extra in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, extra) is not None:
                msg[extra] = getattr(m, extra)
        out.append(msg)
    return out


def _content(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for p in m.content:  # OpenAI content parts: text only
        if p.get("type") != "text":
            raise ValueError(f"messages: content part type {p.get('type')!r} is not supported (text only)")
        parts.append(str(p.get("text", "")))
    return "".join(parts)


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


class _ClientGone(Exception):
    """The client stopped reading: its connection is to be closed."""


def _gone_reason(e: BaseException) -> str:
    inner = getattr(e, "exceptions", None)
    return _gone_reason(inner[0]) if inner else str(e)


class EventStream(StreamingResponse):
    """A streamed (SSE) response whose body generator is closed, and whose `background`
    (freeing the request's rows) runs, however the response ends. Starlette does neither
    when sending fails (a client cut off by _Gate, or gone): the generator would stay
    suspended until the garbage collector finalized it, its rows generating on."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        done = False
        try:
            await super().__call__(scope, receive, send)
            done = True
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # runs the generator's own `finally` (cancels its rows)
            if not done and self.background is not None:
                await self.background()


def failure(e: BaseException) -> tuple[int, str, str | None]:
    """(status, message, param) for a request that failed inside the engine: the client's
    constraint hitting a grammar limit mid-output is the client's (400 naming the field);
    anything else is ours (500)."""
    if isinstance(e, GrammarError):
        return 400, str(e), str(e).split(":")[0] or None
    return 500, f"generation failed: {e!r}", None


def _is_gone(e: BaseException) -> bool:
    if isinstance(e, _ClientGone):
        return True
    inner = getattr(e, "exceptions", None)  # an exception group (Python 3.11+, or anyio's)
    return isinstance(inner, (list, tuple)) and bool(inner) and all(_is_gone(x) for x in inner)


def _cancel(handles: list[Any]) -> None:
    """Free every row of a request that is not finished (each way out of a request)."""
    for h in handles:
        if not h.done:
            h.cancel()


def _tenant(key: str) -> str:
    """A tenant's id: a digest of its API key (keys themselves are never stored)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class _Gate:
    """Pure ASGI middleware in front of every route: API keys, the body bound.

    Pure ASGI rather than Starlette's BaseHTTPMiddleware, whose wrapped `receive` never
    reports a client's disconnect to the endpoint (a non-streaming request then kept its
    row until max_tokens). The body is read here, up to `max_bytes` (413 beyond, unread
    when Content-Length says so), and replayed to the app; later `receive` calls reach
    the server's own, so disconnects are seen. A valid key's tenant id goes into the ASGI
    scope (`fx_tenant`)."""

    def __init__(self, app: Any, tenants: dict[str, str], max_bytes: int, send_timeout: float,
                 unread_bytes: int, body_timeout: float):
        self.app, self.tenants, self.max_bytes = app, tenants, max_bytes
        self.send_timeout, self.unread_bytes = send_timeout, unread_bytes
        self.body_timeout = body_timeout

    def _timed(self, send: Any, sock: Any) -> Any:
        """`send` that gives up on a client whose socket accepts nothing for send_timeout
        seconds (a cut-off slow reader would otherwise hold its connection, its buffered
        events and the server's graceful shutdown for as long as it likes). Served by
        server/connections.py (`sock`: the connection), it also gives up on a streaming
        client that leaves more than `unread_bytes` unread while it reads nothing, or reads
        nothing for send_timeout seconds, however much the kernel's buffers absorb (they
        hold whole generations: `send` alone would never notice such a client)."""
        timeout = getattr(asyncio, "timeout", None)  # Python 3.11+: no task per send
        from fx_engine.server.connections import UnreadBound

        bound = None if sock is None else UnreadBound(sock, self.unread_bytes, self.send_timeout)

        async def timed_send(message: dict) -> None:
            if bound is not None and message.get("more_body"):  # a stream's next part
                why = bound.exceeded()
                if why is not None:
                    raise _ClientGone(why)
            try:
                if timeout is not None:
                    async with timeout(self.send_timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                raise _ClientGone(f"the client accepted nothing for {self.send_timeout} s") from None
        return timed_send

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def logged(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, logged)
        finally:  # the access line: client, request, status (0: no response), duration
            client = scope.get("client") or ("-", 0)
            log.info('%s "%s %s" %s %.1f ms', client[0], scope.get("method"), scope.get("path"),
                     status[0] or "-", 1e3 * (time.perf_counter() - t0))

    async def _handle(self, scope: dict, receive: Any, send: Any) -> None:
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if self.tenants and scope.get("path") not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            key = auth[7:] if auth[:7].lower() == "bearer " else headers.get(
                b"x-api-key", b"").decode("latin-1")  # the anthropic SDK's header
            tenant = self.tenants.get(key)
            if tenant is None:
                return await _route_error(scope.get("path", ""), 401, "missing or invalid API key",
                                          kind="authentication_error")(scope, receive, send)
            scope["fx_tenant"] = tenant
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _route_error(scope.get("path", ""), 400,
                                          "invalid Content-Length header")(scope, receive, send)
            if n > self.max_bytes:
                return await self._too_large(scope, receive, send)
        chunks, total = [], 0
        # The whole body within body_timeout: a client that sends a head and then its body
        # slowly, or never, would hold its connection (and a --max-connections slot) forever
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await _route_error(scope.get("path", ""), 408, f"the request body did not "
                                          f"arrive within {self.body_timeout:g} s")(scope, receive, send)
            if msg["type"] != "http.request":  # the client went away before the body
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        if scope.get("method") == "POST" and b"json" not in headers.get(b"content-type", b"json"):
            # Every POST route takes JSON: a body sent as `curl -d '{...}'` (labelled a form)
            # is read as the JSON it is, as mlx_lm.server and llama.cpp's server do.
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        sock = scope.get("extensions", {}).get("fx.socket")  # see server/connections.py
        try:
            await self.app(scope, replay, self._timed(send, sock))
        except Exception as e:  # (Starlette may wrap it in an exception group)
            if not _is_gone(e):
                raise
            log.warning("%s %s: client cut off: %s", scope.get("method"), scope.get("path"),
                        _gone_reason(e))
            # returning without completing the response: the server closes the connection;
            # served by connections.py, at once, dropping what this client left unread
            if sock is not None:
                sock.abort()

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        await _route_error(scope.get("path", ""), 413, f"request body larger than the server's "
                           f"limit of {self.max_bytes} bytes")(scope, receive, send)


def _route_error(path: str, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the route's API: Anthropic's on /v1/messages and its
    sub-routes (the anthropic SDK reads only that shape), OpenAI's everywhere else."""
    if path.startswith("/v1/messages"):
        from fx_engine.server.anthropic import anthropic_error

        return anthropic_error(status, message, headers)
    return _error(status, message, kind=kind, headers=headers)


def create_app(engine: Engine, model_id: str, api_key: str | Sequence[str] | None = None,
               defaults: dict[str, Any] | None = None, chat_template: str | None = None,
               chat_template_args: dict[str, Any] | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES,
               stream_buffer: int = STREAM_BUFFER, send_timeout: float = SEND_TIMEOUT,
               stream_unread_bytes: int = STREAM_UNREAD_BYTES,
               body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The FastAPI app over a started `engine`. `defaults`: server-wide sampling defaults
    (the CLI's --temp, --top-p, --max-tokens, ...) and speculative decoding settings.
    chat_template / chat_template_args: a Jinja template replacing the model's, and extra
    variables for it (e.g. {"enable_thinking": false}), as mlx_lm.server's flags.
    api_key: one key or several (one per tenant; each gets its own prefix-cache scope);
    then every route but /health needs `Authorization: Bearer KEY` (or `x-api-key`).
    max_request_bytes: the largest request body (413 beyond). stream_buffer: events per
    choice a streaming client may fall behind before it is cut off and its rows freed.
    send_timeout: seconds a client's socket may accept nothing before its connection is
    closed. stream_unread_bytes: bytes a streaming client may leave unread while it reads
    nothing before it is cut off (both seen through the kernel's send queue when served by
    server/connections.py's `server_config`, as `fx-engine serve` does). body_timeout:
    seconds a request body may take to arrive whole (408 beyond)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError("api_key: keys must be non-empty strings")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    if not isinstance(stream_buffer, int) or stream_buffer < 1:
        raise ValueError(f"stream_buffer must be a positive integer, got {stream_buffer!r}")
    if not isinstance(stream_unread_bytes, int) or stream_unread_bytes < 1:
        raise ValueError(f"stream_unread_bytes must be a positive integer, got {stream_unread_bytes!r}")
    app = FastAPI(title="fx-engine", version="0.1.0")
    for name, value in (("send_timeout", send_timeout), ("body_timeout", body_timeout)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    app.add_middleware(_Gate, tenants={k: _tenant(k) for k in keys}, max_bytes=max_request_bytes,
                       send_timeout=float(send_timeout), unread_bytes=stream_unread_bytes,
                       body_timeout=float(body_timeout))
    metrics = Metrics(engine)
    defaults = dict(defaults or {})
    app.state.metrics = metrics
    model = engine.model
    from pathlib import Path

    # The names a request's `model` may give: the id /v1/models lists, or the path it was
    # loaded from, its file name with or without the extension (vLLM answers other names
    # with a 404, as OpenAI does; so does this server, except on Anthropic's route, whose
    # clients send Claude model names they cannot change)
    names = ({model_id, str(model.path), Path(str(model.path)).name, Path(str(model.path)).stem}
             if model.path else {model_id})

    def adapter_of(name: str | None) -> str | None:
        """The LoRA adapter a `model` name selects: `BASE:ADAPTER` (BASE one of the base's
        names) or the adapter's own name (as vLLM names LoRA modules); None: the base."""
        if name is None or name in names:
            return None
        base, sep, rest = name.partition(":")
        loaded = model.adapters.names()
        if sep and base in names and rest in loaded:
            return rest
        return name if name in loaded else None

    def unknown_model(name: str | None, adapters: bool = True) -> Any:
        if name is None or name in names or (adapters and adapter_of(name) is not None):
            return None
        if not adapters and adapter_of(name) is not None:
            return _error(400, f"model: {name!r} is a LoRA adapter; this route serves the base "
                          f"model {model_id!r} only", "model")
        listed = [model_id] + [f"{model_id}:{a}" for a in model.adapters.names()]
        return _error(404, f"model: the model {name!r} does not exist (this server serves "
                      f"{', '.join(map(repr, listed))}; see /v1/models)", "model", kind="not_found_error",
                      code="model_not_found")

    def shown_model(name: str | None) -> str:
        """The `model` a response reports: the base's id, or BASE:ADAPTER."""
        a = adapter_of(name)
        return model_id if a is None else f"{model_id}:{a}"

    app.state.unknown_model = unknown_model
    app.state.adapter_of = adapter_of
    app.state.shown_model = shown_model

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if request.url.path.startswith("/v1/messages"):  # Anthropic's error shape
            from fx_engine.server.anthropic import anthropic_error

            return anthropic_error(400, f"{loc}: {msg}" if loc else msg)
        if not loc and ":" in msg:  # a whole-body check names its field itself
            loc = msg.split(":")[0].split(".")[0]
            return _error(400, msg, loc)
        return _error(400, f"{loc}: {msg}" if loc else msg, loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        return _route_error(request.url.path, exc.status_code, str(exc.detail), kind=kind,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):  # a fault of ours, still JSON
        log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}", kind="server_error")

    @app.head("/health", include_in_schema=False)  # load balancers' probe
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        data = [{"id": model_id, "object": "model", "created": now, "owned_by": "fx-engine",
                 "root": str(model.path), "parent": None}]
        data += [{"id": f"{model_id}:{a}", "object": "model", "created": now, "owned_by": "fx-engine",
                  "root": model.adapters.get(a).raw.path, "parent": model_id}  # vLLM's LoRA entries
                 for a in model.adapters.names()]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str):
        """One model (the openai SDK's `models.retrieve`): any name a request may give,
        reported under its listed id; 404 for the others."""
        bad = unknown_model(name)
        if bad is not None:
            return bad
        shown = shown_model(name)
        return next(m for m in (await models())["data"] if m["id"] == shown)

    @app.get("/metrics")
    async def prom() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def _salt(request: Request, body: _Sampling) -> str | None:
        """The engine's cache_salt: the tenant (API key) and the request's own salt."""
        tenant = request.scope.get("fx_tenant", "")
        if not tenant and body.cache_salt is None:
            return None
        both = f"{tenant}\n{body.cache_salt or ''}".encode("utf-8", "surrogatepass")
        return hashlib.sha256(both).hexdigest()  # fixed length; never echoed in errors

    def _choices(body: _Sampling, kw: dict[str, Any]) -> list[dict[str, Any]]:
        """Each of the n choices' arguments: choice i > 0 draws with seed + i."""
        out = []
        for i in range(body.n):
            k = dict(kw)
            if i and "seed" in k and isinstance(k["seed"], int):
                k["seed"] = (k["seed"] + i) % 2**64
            out.append(k)
        return out

    async def run(request: Request, body: _Sampling, build: Any, chat: bool,
                  tool_names: set[str] | None = None, echoes: list[str] | None = None):
        """Prepare (template, tokenize, validate: `build` on a worker thread) and submit
        all n choices as a unit, then answer (JSON or SSE). Every path out cancels what
        it started."""
        bad = unknown_model(body.model)
        if bad is not None:
            return bad

        def prepare() -> list[Any]:
            built = build()  # one (prompt, kwargs), or a list of them (a list of prompts)
            handles: list[Any] = []
            try:
                for prompt, kw in (built if isinstance(built, list) else [built]):
                    kw["cache_salt"] = _salt(request, body)
                    kw["adapter"] = adapter_of(body.model)
                    handles += engine.submit_many(prompt, _choices(body, kw))
            except BaseException:
                _cancel(handles)  # a later prompt failed: the earlier ones never run
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
        except ValueError as e:
            msg = str(e)
            param = msg.split(" ")[0].split(":")[0] if msg else None
            return _error(400, msg, param)
        except Exception as e:  # a template that fails to render these messages
            if not chat:
                raise
            return _error(400, f"messages: the chat template failed: {e}", "messages")

        metrics.requests += len(handles)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # each prompt counts once, whatever its number of choices (as OpenAI counts)
        prompt_tokens = sum(len(h.prompt_token_ids) for h in handles[:: body.n])
        obj = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(
                _stream(request, handles, rid, created, chat, include_usage, prompt_tokens,
                        getattr(body, "top_logprobs", None) or 0, tool_names,
                        getattr(body, "parallel_tool_calls", None) is False, echoes,
                        getattr(body, "logprobs", None) if not chat else None,
                        shown_model(body.model)),
                media_type="text/event-stream",
                background=BackgroundTask(_cancel, handles))  # also if the body never started
        try:
            outs = await _results(request, handles)
        except Exception as e:  # the request failed inside the engine (a grammar, a processor)
            status, msg, param = failure(e)
            return _error(status, msg, param, kind="server_error" if status >= 500 else
                          "invalid_request_error")
        finally:
            _cancel(handles)
        if outs is None:
            return _error(499, "client disconnected", kind="cancelled")
        for o in outs:
            metrics.observe(o)
        choices = []
        for i, o in enumerate(outs):
            if chat:
                reasoning, text = split_reasoning(think_fmt, o.text, in_reasoning(o.prompt_token_ids))
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if think_fmt is not None:  # the thinking, apart (vLLM's field)
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
                                               first=model.tokenizer.decode(o.prompt_token_ids[:1]))
                c = {"index": i, "text": echoed + o.text, "finish_reason": _finish(o.finish_reason),
                     "logprobs": lps}
            choices.append(c)
        return {"id": rid, "object": obj, "created": created, "model": shown_model(body.model),
                "choices": choices, "usage": _usage(outs, prompt_tokens),
                "system_fingerprint": model.fingerprint}

    async def _until_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _unless_gone(request: Request, waiting: asyncio.Future) -> Any:
        """`waiting`'s result, or None once the client disconnects (or it was cancelled);
        then, or if this handler is cancelled, `waiting` is cancelled."""
        gone = asyncio.ensure_future(_until_disconnect(request))
        left = True  # until `waiting` is seen done
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            left = not waiting.done()
        finally:
            gone.cancel()
            if left:
                waiting.cancel()
        if left:  # (a cancelled gather() does not report cancelled(): its result raises)
            try:
                await waiting
            except asyncio.CancelledError:
                pass
            return None
        return None if waiting.cancelled() else waiting.result()

    async def _results(request: Request, handles: list[Any]) -> list[Any] | None:
        """Every handle's Completion, or None once the client disconnects (the caller
        then cancels the rows: a non-streaming client that leaves frees them too)."""
        return await _unless_gone(request, asyncio.ensure_future(
            asyncio.gather(*[h.aresult() for h in handles])))

    async def _stream(request: Request, handles: list[Any], rid: str, created: int, chat: bool,
                      include_usage: bool, prompt_tokens: int, top_n: int = 0,
                      tool_names: set[str] | None = None, one_call: bool = False,
                      echoes: list[str] | None = None, n_logprobs: int | None = None,
                      shown: str = model_id):
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_choices = len(handles) // len(echoes) if echoes else 1
        echo_due = [bool(echoes)] * len(handles)  # the prompt goes first, with its logprobs
        offsets = [0] * len(handles)  # text_offset: where each choice's next token starts
        tool_streams = ([ToolCallStream(tool_names, 1 if one_call else None) for _ in handles]
                        if tool_names is not None else None)
        thinking = [ReasoningStream(think_fmt, in_reasoning(h.prompt_token_ids)) for h in handles]
        # Bounded: a client that reads slower than the engine generates falls behind by
        # at most `backlog` events; beyond that it is cut off and its rows freed (the
        # engine itself never waits for a socket).
        backlog = stream_buffer * len(handles)
        queue: asyncio.Queue = asyncio.Queue()
        cut_off = asyncio.Event()

        async def pump(i: int, h: Any) -> None:
            try:
                async for ev in h.aiter():
                    if queue.qsize() >= backlog:
                        cut_off.set()
                        _cancel(handles)
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
                    yield _sse({"id": rid, "object": obj, "created": created, "model": shown,
                                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None, "logprobs": None}]})
            while live:
                if cut_off.is_set():
                    yield _sse({"error": {
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
                        yield _sse({"error": {"message": msg, "param": param, "code": None,
                                              "type": "server_error" if status >= 500
                                              else "invalid_request_error"}})
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
                if echo_due[i]:
                    echo_due[i] = False
                    plp = handles[i].prompt_logprobs if n_logprobs is not None else None
                    offsets[i] = len(echoes[i // n_choices])
                    yield _sse({"id": rid, "object": obj, "created": created, "model": shown,
                                "choices": [{"index": i, "text": echoes[i // n_choices],
                                             "finish_reason": None,
                                             "logprobs": _completion_logprobs(
                                                 None, plp, n_logprobs, first=model.tokenizer.decode(
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
                yield _sse(chunk)
            else:
                if include_usage:
                    gen = sum(u.completion_tokens for u in usage_done)
                    yield _sse({"id": rid, "object": obj, "created": created, "model": shown,
                                "choices": [], "usage": {
                                    "prompt_tokens": prompt_tokens, "completion_tokens": gen,
                                    "total_tokens": prompt_tokens + gen,
                                    "prompt_tokens_details": {"cached_tokens": max(
                                        (u.cached_tokens for u in usage_done), default=0)}}})
                yield "data: [DONE]\n\n"
        finally:  # disconnected (or the generator closed): free the rows now
            _cancel(handles)
            for t in tasks:
                t.cancel()

    template = chat_template or model.tokenizer.chat_template
    fmt, renders_tools = tool_format(template)
    think_fmt = reasoning_format(template)

    def in_reasoning(prompt: Sequence[int]) -> bool:
        """Whether a reply to this prompt starts inside a thinking block it opened."""
        return think_fmt is not None and starts_in_reasoning(
            think_fmt, model.tokenizer.decode(list(prompt[-8:])))

    def chat_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    choice: Any, parallel: bool | None, template_kwargs: dict[str, Any] | None,
                    kw: dict[str, Any]) -> list[int]:
        """Prompt ids of chat messages (OpenAI's shapes) with their tools (None: no tools
        in the prompt); adds the tool-call constraint to `kw` when `choice` demands calls.
        On a worker thread (templating and tokenizing release the GIL)."""
        messages = template_messages(messages)
        check_prompt_size(model, text_bytes(messages), "messages")  # before templating
        targs = {**(chat_template_args or {}), **(template_kwargs or {})}
        if tools:
            for i, t in enumerate(tools):  # what a schema may cost, before any walk of it
                check_schema(f"tools.{i}.function.parameters", t["function"].get("parameters"))
            # tool_choice "required" / a named function: the output is constrained to
            # valid calls (schema-checked arguments) in the model's call format
            g = tool_call_grammar(tools, choice, parallel, fmt, model.tokenizer)
            if g is not None:
                if "constraint" in kw:
                    raise ValueError(f"tool_choice: cannot be combined with "
                                     f"{kw['constraint'].field} (give one output constraint)")
                from fx_engine.engine.constraints import parse_constraint

                kw["constraint"] = parse_constraint(grammar=g, names={"grammar": "tools"})
            if not renders_tools and template is not None:
                # the template has no tools section: the default one, in the system
                # prompt (server/tools.py DEFAULT_TOOLS_PROMPT), read back by the parser
                messages, tools = render_tools_in_prompt(messages, tools), None
            else:
                targs.setdefault("tools", tools)
        if chat_template is not None or targs:
            return list(model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True,
                chat_template=chat_template, **targs))
        return prompt_ids(model, messages)

    template_vars: set[str] | None = None
    if template is not None:
        import jinja2
        from jinja2 import meta

        try:
            template_vars = meta.find_undeclared_variables(jinja2.Environment().parse(template))
        except jinja2.TemplateSyntaxError:
            template_vars = None  # rendering reports it

    def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
        """A variable the chat template never reads would change nothing, and one the
        server passes itself (the messages, ...) cannot be set twice: a 400 naming it."""
        for k in kwargs or {}:
            if k in _SERVER_TEMPLATE_ARGS:
                raise ValueError(f"chat_template_kwargs.{k}: the server sets this argument of the "
                                 "chat template itself (from the request's own fields)")
            if template_vars is not None and k not in template_vars:
                raise ValueError(f"chat_template_kwargs.{k}: this model's chat template does not "
                                 f"use it (it reads: {', '.join(sorted(template_vars)) or 'nothing'})")

    app.state.chat_prompt = chat_prompt  # the Anthropic routes build prompts the same way
    app.state.results = _results  # ... and wait for a non-streamed reply the same way
    app.state.chat_template = template

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        use_tools = bool(body.tools) and body.tool_choice != "none"
        if body.top_logprobs and not body.logprobs:
            return _error(400, "top_logprobs: requires logprobs: true", "top_logprobs")
        names = {t.function.name for t in body.tools} if use_tools else None
        choice = body.tool_choice
        if choice not in (None, "none", "auto") and not body.tools:
            return _error(400, "tool_choice: requires tools", "tool_choice")
        if isinstance(choice, dict):
            fn = choice.get("function")
            if (choice.get("type") != "function" or not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str) or set(choice) - {"type", "function"}):
                return _error(400, 'tool_choice: expected "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
            if fn["name"] not in (names or ()):
                return _error(400, f"tool_choice.function.name: no tool named {fn['name']!r} "
                              "in tools", "tool_choice.function.name")
        def build() -> tuple[Any, dict[str, Any]]:  # on a worker thread
            messages = _openai_messages(body.messages)
            kw = _sampling_kwargs(body, defaults)
            if body.logprobs:  # the engine reports the chosen token with >= 1 alternative
                kw["logprobs"] = max(1, body.top_logprobs or 0)
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
            check_template_kwargs(body.chat_template_kwargs)
            targs = {**template_switches(template, body.reasoning_effort),
                     **(body.chat_template_kwargs or {})}
            return chat_prompt(messages, tools, choice, body.parallel_tool_calls, targs, kw), kw

        return await run(request, body, build, chat=True, tool_names=names)

    # ---- the tokenizer (vLLM's routes; lm-evaluation-harness's "remote" tokenizer uses them)
    tok = model.tokenizer

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        names = tok.template_tokens
        name = lambda i: None if i is None else tok.decode([i])  # noqa: E731
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": names.get("eos_token") or (name(tok.eos_ids[0]) if tok.eos_ids else None),
                "bos_token": names.get("bos_token") or name(tok.bos_id),
                "pad_token": names.get("pad_token") or name(tok.pad_id),
                "unk_token": names.get("unk_token") or name(tok.unk_id),
                "add_bos_token": tok.add_bos, "chat_template": chat_template or tok.chat_template,
                "model_max_length": model.config.max_position_embeddings,
                "vocab_size": tok.vocab_size}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            return _error(400, "prompt: give either prompt or messages", "prompt")

        def work() -> dict[str, Any]:  # on a worker thread: a long prompt's work included
            if body.prompt is not None:
                check_prompt_size(model, text_bytes(body.prompt))
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
            else:  # the chat route's messages and template rules
                check_template_kwargs(body.chat_template_kwargs)
                messages = template_messages(_openai_messages(body.messages))
                check_prompt_size(model, text_bytes(messages), "messages")
                targs = {**(chat_template_args or {}), **(body.chat_template_kwargs or {})}
                ids = list(tok.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                    chat_template=chat_template, **targs))
            out: dict[str, Any] = {"count": len(ids), "tokens": ids,
                                   "max_model_len": model.config.max_position_embeddings}
            if body.return_token_strs:  # vLLM's: the vocabulary's tokens (convert_ids_to_tokens)
                table = token_table()
                out["token_strs"] = [table[i] for i in ids]
            return out

        field = "messages" if body.messages is not None else "prompt"
        try:
            # encoded on the worker thread too: FastAPI would walk and encode a long prompt's
            # hundreds of thousands of ids and strings on the event loop
            encoded = await run_in_threadpool(lambda: json.dumps(work()).encode())
            return Response(encoded, media_type="application/json")
        except TemplateError as e:  # the template rejects these messages (raise_exception)
            return _error(400, f"messages: the chat template failed: {e}", "messages")
        except ValueError as e:
            msg = str(e)
            param = msg.split(":")[0] if msg.startswith("chat_template_kwargs.") else field
            return _error(400, msg, param)
        except Exception as e:  # a template that fails to render these messages
            if body.messages is None:
                raise
            return _error(400, f"messages: the chat template failed: {e}", "messages")

    token_strs: list[str | None] = []

    def token_table() -> list[str | None]:
        """Each id's token in the vocabulary (built once: a list index per token then)."""
        if not token_strs:
            vocab = tok.backend.get_vocab(with_added_tokens=True)
            table: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
            for t, i in vocab.items():
                table[i] = t
            token_strs[:] = table
        return token_strs

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        bad = [t for t in body.tokens if not 0 <= t < model.config.vocab_size]
        if bad:
            return _error(400, f"tokens: {bad[0]} is not a token id in [0, "
                          f"{model.config.vocab_size})", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest):
        """Pooled, normalized final hidden states (engine/embeddings.py: the checkpoint's
        pooling), batched, computed on the engine's thread one bounded call per engine
        step (at most its step_token_budget tokens), beside generation; a client that
        disconnects cancels the rest."""
        from fx_engine.engine.embeddings import embed_steps

        bad = unknown_model(body.model, adapters=False)
        if bad is not None:
            return bad
        x = body.input
        inputs = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        if not inputs or any(not i for i in inputs):
            return _error(400, "input: must not be empty (nor hold an empty input)", "input")
        if len(inputs) > 2048:
            return _error(400, f"input: at most 2048 inputs, got {len(inputs)}", "input")
        hidden = model.config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            return _error(400, f"dimensions: this model's embeddings have {hidden} dimensions "
                          "(it does not declare shorter ones)", "dimensions")
        try:
            ids = await run_in_threadpool(lambda: [prompt_ids(model, i) for i in inputs])
            steps = await run_in_threadpool(
                lambda: embed_steps(model, ids, step_tokens=engine.step_token_budget))
            # None once the client leaves: cancelling the wrapper cancels the job, which
            # the engine drops at its next step
            vecs = await _unless_gone(request, asyncio.wrap_future(engine.call_steps(steps)))
        except EngineClosed as e:
            return _error(503, str(e), kind="server_error")
        except ValueError as e:
            return _error(400, f"input: {e}".replace("input: input", "input"), "input")
        if vecs is None:
            return _error(499, "client disconnected", kind="cancelled")
        import base64

        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                 if body.encoding_format == "base64" else v.tolist()}
                for i, v in enumerate(vecs)]
        n = sum(len(i) for i in ids)
        return {"object": "list", "data": data, "model": model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        # one prompt (a string or token ids) or a list of them: one choice per prompt (and
        # per n), index = prompt * n + choice, as OpenAI numbers them
        p = body.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(not x for x in prompts):
            return _error(400, "prompt: must not be empty", "prompt")
        if len(prompts) * body.n > max(1, engine.max_queue):
            return _error(400, f"prompt: {len(prompts)} prompts x n={body.n} exceed the "
                          f"server's queue of {engine.max_queue}", "prompt")
        if body.max_tokens == 0 and not body.echo:
            return _error(400, "max_tokens: 0 generates nothing; it needs echo: true "
                          "(scoring the prompt)", "max_tokens")
        echoes: list[str] = []

        def build() -> list[tuple[Any, dict[str, Any]]]:  # on a worker thread
            kw = _sampling_kwargs(body, defaults)
            if body.logprobs is not None:  # 0: the chosen token's logprob, no alternatives
                kw["logprobs"] = max(1, body.logprobs)
                if body.echo:
                    kw["prompt_logprobs"] = body.logprobs
            jobs = []
            for x in prompts:
                ids = prompt_ids(model, x)
                if body.echo:
                    echoes.append(x if isinstance(x, str) else model.tokenizer.decode(ids))
                jobs.append((ids, dict(kw)))
            return jobs

        return await run(request, body, build, chat=False, echoes=echoes if body.echo else None)

    from types import SimpleNamespace

    from fx_engine.server import anthropic

    anthropic.install(app, engine, model_id, defaults,
                      lambda request: _salt(request, SimpleNamespace(cache_salt=None)),
                      think_fmt, in_reasoning, metrics)
    from fx_engine.server import responses

    responses.install(app, engine, model_id, defaults,
                      lambda request: _salt(request, SimpleNamespace(cache_salt=None)),
                      think_fmt, in_reasoning, metrics)
    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
