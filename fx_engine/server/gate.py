"""The server's gate: pure ASGI middleware in front of every route (API keys and tenants,
the request body's size and arrival time bounds, the access log, cutting off a client that
stops reading)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from fx_engine.server.protocol import _route_error, log

OPEN_PATHS = frozenset({"/health"})  # answered without an API key
PAGE_PATHS = frozenset({"/"})  # GET and HEAD answered without one: the web chat page (webchat.py), no data


class _ClientGone(Exception):
    """The client stopped reading: its connection is to be closed."""


def _gone_reason(e: BaseException) -> str:
    inner = getattr(e, "exceptions", None)
    return _gone_reason(inner[0]) if inner else str(e)


def _is_gone(e: BaseException) -> bool:
    if isinstance(e, _ClientGone):
        return True
    inner = getattr(e, "exceptions", None)  # an exception group (Python 3.11+, or anyio's)
    return isinstance(inner, (list, tuple)) and bool(inner) and all(_is_gone(x) for x in inner)


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
        if self.tenants and scope.get("path") not in OPEN_PATHS and not (
                scope.get("path") in PAGE_PATHS and scope.get("method") in ("GET", "HEAD")):
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
