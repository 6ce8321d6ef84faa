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

The parts (this module only composes them; nothing in server/ imports it):
* protocol.py: request-body base types, the error bodies and exception handlers, the one
  streaming response (`EventStream`), waiting on rows while watching the client;
* context.py: `ServerSettings` (the limits above) and `ServerContext` (the engine, the
  served names, sampling defaults, metrics, the chat template's formats; the `Ctx`
  dependency every route takes);
* gate.py: the ASGI middleware in front of every route (API keys, body bounds, access log);
* pool.py: several models in one server (`ModelPool`: routing by `model`, loading on
  demand within a memory budget, unloading idle ones; its `Leases` middleware);
* one router per API surface: info.py (/health, /v1/models, /metrics), chat.py and
  completions.py (with generation.py, what they share), tokenization.py, embeddings.py,
  anthropic.py (/v1/messages), responses.py (/v1/responses).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute

from fx_engine.engine.engine import Engine
from fx_engine.server import anthropic, chat, completions, embeddings, info, responses, tokenization, webchat
from fx_engine.server.context import (BODY_TIMEOUT, IMAGE_URL_BYTES, IMAGE_URL_TIMEOUT, MAX_REQUEST_BYTES,
                                      SEND_TIMEOUT, STREAM_BUFFER, STREAM_UNREAD_BYTES, ServerContext,
                                      ServerSettings)
from fx_engine.server.gate import OPEN_PATHS, _Gate, _tenant
from fx_engine.server.pool import Leases, ModelPool, ModelSpec, ModelUnavailable
from fx_engine.server.protocol import (EventStream, _error, anthropic_error, failure,
                                       install_error_handlers, log)

__all__ = ["create_app", "ModelPool", "ModelSpec", "EventStream", "failure", "log", "MAX_REQUEST_BYTES",
           "STREAM_BUFFER", "SEND_TIMEOUT", "BODY_TIMEOUT", "STREAM_UNREAD_BYTES", "OPEN_PATHS"]

#: The API surfaces, in the order their routes are added (the OpenAPI document's order).
ROUTERS = (info.router, chat.router, tokenization.router, embeddings.router, completions.router,
           anthropic.router, responses.router, webchat.router)


def create_app(engine: Engine | ModelPool, model_id: str | None = None,
               api_key: str | Sequence[str] | None = None,
               defaults: dict[str, Any] | None = None, chat_template: str | None = None,
               chat_template_args: dict[str, Any] | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES,
               stream_buffer: int = STREAM_BUFFER, send_timeout: float = SEND_TIMEOUT,
               stream_unread_bytes: int = STREAM_UNREAD_BYTES,
               body_timeout: float = BODY_TIMEOUT, image_urls: bool = True,
               image_url_bytes: int = IMAGE_URL_BYTES, image_url_timeout: float = IMAGE_URL_TIMEOUT) -> FastAPI:
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
    seconds a request body may take to arrive whole (408 beyond). image_urls: fetch images
    that requests name by http(s) URL (False: a 400 asking for a data URL), each at most
    image_url_bytes and image_url_timeout seconds (server/media.py).

    Several models: `engine` a `ModelPool` (server/pool.py; model_id None, each model's id
    is its spec's name): requests route by their `model`, models load on demand within the
    pool's memory budget (503 with Retry-After when it is held by models in use), idle ones
    unload; /v1/models lists them all, /metrics labels each model's samples. The app closes
    the pool's engines when it shuts down."""
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    settings = ServerSettings(keys, max_request_bytes, stream_buffer, send_timeout,
                              stream_unread_bytes, body_timeout, image_urls, image_url_bytes,
                              image_url_timeout)  # checked: a ValueError
    pool = engine if isinstance(engine, ModelPool) else None
    if pool is not None and model_id is not None:
        raise ValueError("model_id: a ModelPool's models are named by their specs")
    if pool is None and model_id is None:
        raise ValueError("model_id: the id /v1/models lists is needed")
    app = FastAPI(title="fx-engine", version="0.1.0", lifespan=_closing(pool) if pool else None)
    if pool is not None:  # (inside the gate: it sees the body the gate replays)
        app.add_middleware(Leases, pool=pool)
    app.add_middleware(_Gate, tenants={k: _tenant(k) for k in settings.api_keys},
                       max_bytes=settings.max_request_bytes, send_timeout=settings.send_timeout,
                       unread_bytes=settings.stream_unread_bytes, body_timeout=settings.body_timeout)
    app.state.pool = pool
    if pool is None:
        ctx = ServerContext.build(engine, model_id, settings, defaults, chat_template, chat_template_args)
        app.state.context = ctx  # what every route gets as its `Ctx` (context.server_context)
        app.state.metrics = ctx.metrics
    else:
        def context(eng: Engine, spec: ModelSpec, metrics: Any, own: Any) -> ServerContext:
            return ServerContext.build(eng, spec.name, settings, {**(defaults or {}), **(own or {})},
                                       chat_template, chat_template_args, metrics=metrics,
                                       aliases=pool.entry_of(spec.name).names, catalog=pool.catalog)
        pool.attach(context)
        app.state.context = None  # per request: the model it names (context.server_context)
        app.add_exception_handler(ModelUnavailable, _unavailable)
    install_error_handlers(app)
    for router in ROUTERS:
        _add_routes(app, router)
    return app


def _add_routes(app: FastAPI, router: APIRouter) -> None:
    """`router`'s routes as the app's own, each an entry of `app.routes` (recent FastAPI
    versions' `include_router` nests a router in one entry: `app.routes` would then no
    longer list every path, as tools that walk it, and the API-key test, expect)."""
    for route in router.routes:
        assert isinstance(route, APIRoute), route
        app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods), name=route.name,
                          include_in_schema=route.include_in_schema)


def _closing(pool: ModelPool) -> Any:
    """The app's lifespan with a pool: its engines closed when the server stops."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        try:
            yield
        finally:
            pool.close()
    return lifespan


async def _unavailable(request: Request, exc: Exception):
    """A request's model cannot serve it (server/pool.py): 404, 503 with Retry-After, 500;
    in the route's API shape."""
    assert isinstance(exc, ModelUnavailable)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    if request.url.path.startswith("/v1/messages"):
        return anthropic_error(exc.status, exc.message, headers)
    return _error(exc.status, exc.message, "model", kind=exc.kind, headers=headers, code=exc.code)
