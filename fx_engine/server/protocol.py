"""What every API surface of the server shares: request-body base types, the error bodies
(OpenAI's and Anthropic's shapes) and exception handlers, the one streaming response, and
waiting on a request's rows while watching its client.

The surfaces (routers: completions.py, chat.py, tokenization.py, embeddings.py, info.py,
anthropic.py, responses.py) import this module and context.py; nothing here imports them,
and nothing in server/ imports app.py, which only composes them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from fx_engine.engine.grammar_guard import GrammarError
from fx_engine.server.fields import check_fields

#: The server's logger: one access line per request (INFO), every 4xx (WARNING) and 5xx
#: (ERROR) with its reason; `fx-engine serve --log-level` sets the level.
log = logging.getLogger("fx_engine.server")


# ---- request bodies

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


# ---- errors

def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None, code: str | None = None):
    """OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`), logged."""
    log.log(logging.ERROR if status >= 500 else logging.WARNING, "%d %s: %s", status, kind,
            message[:500])
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": code}})


def context_error(e: Any, model: Any, what: str, length_field: str = "max_tokens"):
    """A request longer than the context (`ContextLengthExceeded`) as OpenAI and vLLM word
    it ("This model's maximum context length is N tokens. However, ..."), code
    context_length_exceeded: the phrase and code clients (LiteLLM, LangChain) look for to
    trim a conversation. `what`: the field the prompt came in (messages, prompt, input);
    `length_field`: the one that asked for the completion's length.
    A server-side cap (--max-kv-size) says so, with the model's own length."""
    own = int(model.config.max_position_embeddings)
    cap = f" (the server's --max-kv-size; the model's own is {own})" if e.limit < own else ""
    head = f"This model's maximum context length is {e.limit} tokens{cap}. However, "
    p, m = e.prompt_tokens, e.max_tokens
    if p is None:  # refused before tokenizing: the engine's message has the byte counts
        tail = f"{e}. Please reduce the length of the {what}."
    elif p > e.limit:  # no completion fits: blame the prompt, not max_tokens
        tail = f"your {what} resulted in {p} tokens. Please reduce the length of the {what}."
    else:
        tail = (f"you requested {p + m} tokens ({p} in the {what}, {m} in the completion). "
                f"Please reduce the length of the {what} or completion ({length_field}).")
    return _error(400, head + tail, what, code="context_length_exceeded")


def server_defaults(kw: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """kw with serve's --seed, --repetition-penalty and --stop where the request left them
    unset (the API surfaces without those fields take them from the server, as chat
    completions does): a flag the server accepted is never ignored."""
    for name in ("seed", "repetition_penalty", "stop"):
        if kw.get(name) is None and defaults.get(name) is not None:
            kw[name] = defaults[name]
    return kw


def speculation(kw: dict[str, Any], defaults: dict[str, Any], wanted: bool | None) -> dict[str, Any]:
    """kw with the server's speculative decoding (serve --draft-model, --prompt-lookup,
    --num-draft-tokens) unless the request opted out (`speculative_decoding: false`, an
    fx-engine field on every generation route: the output is the same either way, only its
    speed differs)."""
    if wanted is False:
        return kw
    for name in ("draft_model", "num_draft_tokens", "prompt_lookup"):
        if defaults.get(name) is not None:
            kw[name] = defaults[name]
    return kw


def room_left(max_tokens: int, prompt_tokens: int, context: int) -> int:
    """max_tokens clamped to what the context leaves after the prompt (a client's default
    that it never chose: Claude Code asks for 32,000 whatever the model, and a server's
    --max-tokens may exceed a --max-kv-size): the reply then stops with a "length" finish.
    A prompt that leaves no room keeps max_tokens, so that the engine's 400 says why."""
    room = context + 1 - prompt_tokens  # the last sampled token is never written to the cache
    return min(max_tokens, room) if room >= 1 else max_tokens


#: Anthropic's error type of each status.
ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 408: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None,
                    details: dict[str, Any] | None = None) -> JSONResponse:
    """Anthropic's error body; `details` (e.g. an `error_code`) is what its SDK reads to
    recover by itself."""
    log.warning("%d %s: %s", status, ANTHROPIC_KINDS.get(status, "api_error"), message[:500])
    error: dict[str, Any] = {"type": ANTHROPIC_KINDS.get(status, "api_error"), "message": message}
    if details is not None:
        error["details"] = details
    return JSONResponse(status_code=status, headers=headers, content={"type": "error", "error": error})


def _route_error(path: str, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the route's API: Anthropic's on /v1/messages and its
    sub-routes (the anthropic SDK reads only that shape), OpenAI's everywhere else."""
    if path.startswith("/v1/messages"):
        return anthropic_error(status, message, headers)
    return _error(status, message, kind=kind, headers=headers)


def failure(e: BaseException) -> tuple[int, str, str | None]:
    """(status, message, param) for a request that failed inside the engine: the client's
    constraint hitting a grammar limit mid-output is the client's (400 naming the field);
    anything else is ours (500)."""
    if isinstance(e, GrammarError):
        return 400, str(e), str(e).split(":")[0] or None
    return 500, f"generation failed: {e!r}", None


async def _invalid(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if request.url.path.startswith("/v1/messages"):  # Anthropic's error shape
        return anthropic_error(400, f"{loc}: {msg}" if loc else msg)
    if not loc and ":" in msg:  # a whole-body check names its field itself
        loc = msg.split(":")[0].split(".")[0]
        return _error(400, msg, loc)
    return _error(400, f"{loc}: {msg}" if loc else msg, loc or None)


async def _http(request: Request, exc: StarletteHTTPException):
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    return _route_error(request.url.path, exc.status_code, str(exc.detail), kind=kind,
                        headers=getattr(exc, "headers", None))


async def _crash(request: Request, exc: Exception):  # a fault of ours, still JSON
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, f"internal error: {type(exc).__name__}", kind="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Every error `app` answers in its route's API shape: invalid bodies (400 naming the
    field), HTTP errors (404, 405, ...), and a fault of the server (500, still JSON)."""
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _crash)


# ---- streaming

def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event: `data: JSON`, after `event: NAME` when named."""
    if event is None:
        return f"data: {json.dumps(data)}\n\n"
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class EventStream(StreamingResponse):
    """A streamed (SSE) response whose body generator is closed, and whose `background`
    (freeing the request's rows) runs, however the response ends. Starlette does neither
    when sending fails (a client cut off by the gate, or gone): the generator would stay
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


# ---- a request's rows and its client

def cancel(handles: list[Any]) -> None:
    """Free every row of a request that is not finished (each way out of a request)."""
    for h in handles:
        if not h.done:
            h.cancel()


def request_salt(request: Request, cache_salt: str | None) -> str | None:
    """The engine's cache_salt: the tenant (API key, see gate.py) and the request's own salt."""
    tenant = request.scope.get("fx_tenant", "")
    if not tenant and cache_salt is None:
        return None
    both = f"{tenant}\n{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(both).hexdigest()  # fixed length; never echoed in errors


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, waiting: asyncio.Future) -> Any:
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


async def results(request: Request, handles: list[Any]) -> list[Any] | None:
    """Every handle's Completion, or None once the client disconnects (the caller then
    cancels the rows: a non-streaming client that leaves frees them too)."""
    return await unless_gone(request, asyncio.ensure_future(
        asyncio.gather(*[h.aresult() for h in handles])))
