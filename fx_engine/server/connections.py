"""Connection limits for the HTTP server: what a client's sockets may hold, and for how long.

    config = server_config(app, host="127.0.0.1", port=8080)   # a uvicorn.Config
    uvicorn.Server(config).run()

uvicorn alone closes nothing that has not completed a request: a socket that connects and
sends nothing, or sends a request head a byte at a time (slowloris), is held forever. The
protocol here (uvicorn's h11 protocol, extended) adds:

* **A request-head deadline** (`header_timeout`, default 10 s): from the connection's start
  or the end of its previous response, the whole request head must arrive within it; else
  the connection is closed (a 408 first if part of a head came). Idle keep-alive
  connections are closed after `timeout_keep_alive` (uvicorn's, default 5 s).
* **A connection limit** (`max_connections`, default 512): a connection beyond it gets a
  503 (JSON, `Retry-After`) to its request and is closed; `/health` is answered anyway (a
  load balancer's probe must not see a full server as a dead one). The request body's own
  deadline is server/gate.py's (`body_timeout`, 30 s: a 408), on any server.
* **What a client has not read, seen from the server** (`ConnectionSocket`, in the ASGI
  scope as `scope["extensions"]["fx.socket"]`): the bytes written to the connection and
  not yet acknowledged by the client's TCP stack (the server's transport buffer plus the
  kernel's send queue). Kernel socket buffers hold megabytes: without this, a client that
  never reads looks, to `send`, like one that reads everything. The streaming routes cut
  off a client whose unread bytes grow while it reads nothing (server/gate.py `_Gate`).
  What the client's own receive buffer holds (acknowledged, not yet read by the client
  program) cannot be seen by the server: a stream is cut off only once that is full.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

OPEN_PATHS = frozenset({"/health"})  # answered beyond the connection limit too
HEADER_TIMEOUT = 10.0  # seconds a request head may take (from connect or the last response)
KEEP_ALIVE_TIMEOUT = 5  # seconds an idle connection is kept between requests (uvicorn's)
MAX_CONNECTIONS = 512  # open connections beyond this get a 503 and are closed
_SO_NWRITE = 0x1024  # macOS: bytes in the send buffer not yet acknowledged


def _kernel_unacked(sock: Any) -> int:
    """Bytes the kernel holds for this TCP socket, unsent or unacknowledged (Linux
    SIOCOUTQ, macOS SO_NWRITE); 0 where neither exists (then the transport's own buffer
    is all that is seen)."""
    if sock is None:
        return 0
    try:
        if sys.platform == "linux":
            import fcntl
            import termios

            return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4),
                                  sys.byteorder, signed=True)
        if sys.platform == "darwin":
            return sock.getsockopt(socket.SOL_SOCKET, _SO_NWRITE)
    except OSError:  # closed meanwhile
        return 0
    return 0


class ConnectionSocket:
    """One connection's transport, counting what is written to it: how much of that the
    client has not yet taken (`waiting`), how much it has (`delivered`), and a way to drop
    a client that never will (`abort`)."""

    def __init__(self, transport: asyncio.Transport, stall_timeout: float):
        self._transport = transport
        self._sock = transport.get_extra_info("socket")
        self.written = 0
        self.stall_timeout = stall_timeout

    # the transport interface uvicorn's protocol uses, with writes counted
    def write(self, data: bytes) -> None:
        self.written += len(data)
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def waiting(self) -> int:
        """Bytes written and not yet acknowledged by the client."""
        return self._transport.get_write_buffer_size() + _kernel_unacked(self._sock)

    def delivered(self) -> int:
        return self.written - self.waiting()

    def abort(self) -> None:
        """Close now, discarding what the client never took (a plain close would wait for
        a client that never reads, holding the socket and its buffers for good)."""
        self._transport.abort()

    def close(self) -> None:
        """Close once the client took what waits for it; abort if meanwhile it takes
        nothing for `stall_timeout` seconds (asyncio's close alone would wait forever for
        a client that never reads, holding the connection, its slot and its buffers)."""
        self._transport.close()
        if not self.waiting():
            return
        loop = asyncio.get_running_loop()

        def check(before: int) -> None:
            if self.waiting():
                if self.delivered() == before:
                    self.abort()
                else:
                    loop.call_later(self.stall_timeout, check, self.delivered())
        loop.call_later(self.stall_timeout, check, self.delivered())


class UnreadBound:
    """Whether a stream's client must be cut off: it has read nothing for a second while
    more than `max_bytes` wait for it, or nothing for `stall_timeout` seconds while any
    bytes wait. (The one-second grace lets a reading client take one large event, an
    echoed prompt, without being cut off.)"""

    READING = 1.0  # seconds without any byte taken: the client is not reading right now

    def __init__(self, sock: ConnectionSocket, max_bytes: int, stall_timeout: float):
        self.sock, self.max_bytes, self.stall_timeout = sock, max_bytes, stall_timeout
        self._delivered = sock.delivered()
        self._progress = time.monotonic()

    def exceeded(self) -> str | None:
        """None, or why the client is cut off."""
        now, delivered, waiting = time.monotonic(), self.sock.delivered(), self.sock.waiting()
        if delivered != self._delivered or waiting == 0:
            self._delivered, self._progress = delivered, now
            return None
        idle = now - self._progress
        if waiting > self.max_bytes and idle >= self.READING:
            return f"the client left more than {self.max_bytes} bytes unread"
        if idle >= self.stall_timeout:
            return f"the client read nothing for {self.stall_timeout:g} s"
        return None


def _error_body(path: str, message: str, kind: str, code: str, anthropic_kind: str = "") -> bytes:
    """An error in the route's shape (Anthropic's on /v1/messages, else OpenAI's)."""
    if path.startswith("/v1/messages"):
        body: dict = {"type": "error", "error": {"type": anthropic_kind or kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body).encode()


async def _over_limit(scope: dict, receive: Any, send: Any) -> None:
    body = _error_body(scope.get("path", ""), "too many open connections to this server; retry "
                       "shortly", "server_error", "too_many_connections", "overloaded_error")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline, a connection limit and a
    counting transport (see the module docstring). Settings come from the uvicorn Config
    (`fx_header_timeout`, `fx_max_connections`), set by `server_config`."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.header_timeout = getattr(config, "fx_header_timeout", HEADER_TIMEOUT)
        self.max_connections = getattr(config, "fx_max_connections", MAX_CONNECTIONS)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # the protocol and its request cycles write and close through it
        sock = self.transport = ConnectionSocket(transport, self.header_timeout)
        inner, over = self.app, len(self.connections) > self.max_connections

        async def app(scope: dict, receive: Any, send: Any) -> None:
            scope.setdefault("extensions", {})["fx.socket"] = sock
            if over and scope.get("path") not in OPEN_PATHS:  # a health probe still answers
                return await _over_limit(scope, receive, send)
            await inner(scope, receive, send)
        self.app = app
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request head has arrived
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head (or idleness) is timed anew
        super().on_response_complete()  # (may start a pipelined request: disarms again)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why it is dropped
            body = _error_body("", f"the request head did not arrive within "
                               f"{self.header_timeout:g} s", "invalid_request_error",
                               "request_timeout")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
        self.transport.close()


def server_config(app: Any, host: str = "127.0.0.1", port: int = 8080,
                  header_timeout: float = HEADER_TIMEOUT,
                  timeout_keep_alive: int = KEEP_ALIVE_TIMEOUT,
                  max_connections: int = MAX_CONNECTIONS, **kwargs: Any) -> Any:
    """A uvicorn.Config serving `app` with these connection limits (other uvicorn
    settings in `kwargs`)."""
    import uvicorn

    for name, value in (("header_timeout", header_timeout), ("timeout_keep_alive", timeout_keep_alive)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if not isinstance(max_connections, int) or isinstance(max_connections, bool) or max_connections < 1:
        raise ValueError(f"max_connections must be a positive integer, got {max_connections!r}")
    config = uvicorn.Config(app, host=host, port=port, http=LimitedH11Protocol,
                            timeout_keep_alive=timeout_keep_alive, **kwargs)
    config.fx_header_timeout = float(header_timeout)
    config.fx_max_connections = max_connections
    return config
