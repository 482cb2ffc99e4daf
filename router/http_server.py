"""The router's HTTP/1.1 server: asyncio protocols over httptools' parser, on uvloop's event loop.

Why not uvicorn: per request, the ASGI layer (scope and message dicts, a send coroutine per message, its
flow-control waits) cost the router more CPU than all of its routing; a forwarding proxy written on
protocols costs a fraction of one written on ASGI (``docs/perf/router.md``). This server parses each
request straight from ``data_received`` and hands it, as an `Exchange`, to the generate handler (``POST
/v1/completions`` and ``/v1/chat/completions``); every other request goes to the FastAPI control plane
through `router.asgi_bridge`, where a framework costs nothing that matters.

HTTP/1.1: keep-alive (closed after ``keepalive_secs`` idle), pipelined requests answered in order,
``Content-Length`` and chunked request bodies, ``Expect: 100-continue``, HTTP/1.0 clients (close-delimited
streams). Limits, checked before anything else runs: request headers (431), body size (the generate handler
answers 413; a body announced too large is not read, and the connection is closed after the answer). No
TLS and no HTTP/2: the router sits behind a Kubernetes Service or an ingress that terminates them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from pd_cluster.router.asgi_bridge import run_asgi
from pd_cluster.router.errors import error_body
from pd_cluster.router.exchange import Exchange, Headers, status_line

log = logging.getLogger("pd_cluster.router.http_server")

GENERATE_PATHS = frozenset({b"/v1/completions", b"/v1/chat/completions", b"/v1/responses"})
MAX_PIPELINED = 16
"""Requests queued on one connection behind the one being answered; past it the connection stops reading."""


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests and answers them one at a time, in order."""

    def __init__(self, server: "HttpServer") -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.write_paused = False
        self.resume_callbacks: list[Callable[[], None]] = []
        self.current: Exchange | None = None
        self.pending: deque[Exchange] = deque()
        self.idle_since = time.monotonic()
        self._reading_paused = False
        self._early: Exchange | None = None  # answered before its body was read (413, 431)
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: Headers = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._too_large = False
        self._refusal: tuple[int, str] | None = None  # answered by the server itself (431)

    # ---- asyncio.Protocol ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.pending.clear()
        for ex in (self.current, self._early):
            if ex is not None and not ex.finished and ex.on_lost is not None:
                ex.on_lost()
        callbacks, self.resume_callbacks = self.resume_callbacks, []
        for fn in callbacks:  # a paused relay must see the end too
            fn()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        callbacks, self.resume_callbacks = self.resume_callbacks, []
        for fn in callbacks:
            fn()

    # ---- httptools callbacks ----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.server.limits.max_header_bytes:
            self._refuse(414, "the request target is longer than the header limit")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > 2 * self.server.limits.max_header_bytes + 65536:
            self._refuse(431, "request headers far past the limit")  # stop buffering before they end
            return
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        lim = self.server.limits
        headers = self._headers
        idle = self.current is None and not self.pending  # else answers go out in order, after the body
        if len(headers) > lim.max_header_count or self._header_bytes > lim.max_header_bytes:
            why = (f"{len(headers)} request headers; at most {lim.max_header_count} are accepted"
                   if len(headers) > lim.max_header_count else
                   f"request headers of {self._header_bytes} bytes; at most {lim.max_header_bytes} are accepted")
            self.server.on_rejected("header_too_large")
            self._too_large = True  # read no body
            self._refusal = (431, why)
            if idle:
                ex = self._early = self._new_exchange(None)
                ex.keep_alive = False
                ex.respond(431, error_body(431, why))
            return
        length = _content_length(headers)
        if length is not None and length > lim.max_payload_size:
            self._too_large = True
            if idle:  # answered before the body is read; the connection closes after it
                ex = self._early = self._new_exchange(None)
                ex.too_large, ex.keep_alive = True, False
                self.server.dispatch(ex)  # the handler answers 413 (and counts it)
            return
        if idle:
            for name, value in headers:
                if name == b"expect" and value.lower() == b"100-continue":
                    self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._body_size += len(body)
        if self._body_size > self.server.limits.max_payload_size:
            self._too_large = True
            self._body = []
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            if early.finished:
                self.close()
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        ex = self._new_exchange(body)
        if self._too_large:
            ex.too_large, ex.body = True, None
        if self._refusal is not None:
            ex.refusal, ex.keep_alive = self._refusal, False
        if self.current is None:
            self._start(ex)
        else:
            self.pending.append(ex)
            if len(self.pending) >= MAX_PIPELINED and not self._reading_paused and self.transport is not None:
                self._reading_paused = True
                self.transport.pause_reading()

    # ---- exchanges ----------------------------------------------------------------------------------------------
    def _new_exchange(self, body: bytes | None) -> Exchange:
        url = self._url
        q = url.find(b"?")
        path, query = (url, b"") if q < 0 else (url[:q], url[q + 1:])
        p = self.parser
        return Exchange(self, p.get_method().decode("latin-1"), path, query, self._headers, body,
                        p.should_keep_alive(), p.get_http_version() == "1.1")

    def _start(self, ex: Exchange) -> None:
        self.current = ex
        self.server.dispatch(ex)

    def _refuse(self, status: int, message: str) -> None:
        if self.current is None and self.transport is not None and not self.closed:
            body = error_body(status, message)
            self.write(status_line(status) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                       b"connection: close\r\n\r\n%b" % (len(body), body))
        self.close()

    def exchange_done(self, ex: Exchange) -> None:
        """The response of ``ex`` was written in full."""
        if ex is not self.current:  # answered before its body was read (413, 431): nothing more comes
            if ex is not self._early:  # the body was read (or dropped) meanwhile
                self.close()
            return  # else on_message_complete closes once the body is past
        self.current = None
        if not ex.keep_alive or self.server.closing:
            self.close()
        elif self.pending:
            self._start(self.pending.popleft())
            if self._reading_paused and len(self.pending) < MAX_PIPELINED // 2 and self.transport is not None:
                self._reading_paused = False
                self.transport.resume_reading()
        else:
            self.idle_since = time.monotonic()

    def close_after_exchange(self, ex: Exchange, abort: bool = False) -> None:
        if ex is self.current:
            self.current = None
        self.close()

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.pending) or self._early is not None


def _content_length(headers: Headers) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class HttpServer:
    """Listens, owns the connections, and dispatches exchanges.

    Args:
        generate: coroutine function answering a generate request.
        control: the ASGI app of every other path.
        limits: ``max_header_bytes``, ``max_header_count``, ``max_payload_size`` (``router.config.LimitsConfig``).
        on_rejected: counts a request refused here, by reason (``header_too_large``).
        keepalive_secs: idle client connections are closed after this long.
    """

    def __init__(self, generate: Callable[[Exchange], Awaitable[Any]], control: Any, limits: Any,
                 on_rejected: Callable[[str], None] = lambda reason: None, keepalive_secs: float = 75.0) -> None:
        self.generate = generate
        self.control = control
        self.limits = limits
        self.on_rejected = on_rejected
        self.keepalive_secs = keepalive_secs
        self.connections: set[HttpConnection] = set()
        self.closing = False
        self._servers: list[asyncio.base_events.Server] = []
        self._sweeper: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def listen(self, host: str, port: int, backlog: int = 4096, reuse_port: bool = False) -> None:
        self._loop = loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: HttpConnection(self), host, port, backlog=backlog,
                                          reuse_port=reuse_port or None)
        self._servers.append(server)
        self._sweeper = loop.call_later(1.0, self._sweep)

    @property
    def port(self) -> int:
        return self._servers[0].sockets[0].getsockname()[1]

    def dispatch(self, ex: Exchange) -> None:
        if ex.refusal is not None:
            ex.respond(ex.refusal[0], error_body(*ex.refusal))
            return
        loop = self._loop or asyncio.get_running_loop()
        if ex.method == "POST" and ex.path in GENERATE_PATHS:
            ex.task = loop.create_task(self.generate(ex))
        else:
            ex.task = loop.create_task(run_asgi(self.control, ex))
        ex.task.add_done_callback(lambda task: _settle(ex, task))

    def _sweep(self) -> None:
        """Close client connections idle longer than ``keepalive_secs``."""
        cutoff = time.monotonic() - self.keepalive_secs
        for conn in list(self.connections):
            if not conn.busy and conn.idle_since < cutoff:
                conn.close()
        if not self.closing and self._loop is not None:
            self._sweeper = self._loop.call_later(1.0, self._sweep)

    def stop_accepting(self) -> None:
        """Close the listening sockets and every idle connection; answers in progress go on."""
        self.closing = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()

    def active(self) -> list[Exchange]:
        return [c.current for c in self.connections if c.current is not None and not c.current.finished]

    async def drain(self, grace_secs: float) -> int:
        """Wait up to ``grace_secs`` for the answers in progress, then cancel what is left (returns how many)."""
        deadline = time.monotonic() + grace_secs
        while self.active() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.active()
        for ex in left:
            if ex.task is not None:
                ex.task.cancel()
        if left:
            await asyncio.gather(*(ex.task for ex in left if ex.task is not None), return_exceptions=True)
        for conn in list(self.connections):
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        return len(left)


def _settle(ex: Exchange, task: asyncio.Task) -> None:
    """A handler that ended without finishing its response: 500, or a cut stream; its error is logged."""
    exc = None if task.cancelled() else task.exception()
    if exc is not None:
        log.error("request handler failed", exc_info=exc, extra={"path": ex.path.decode("latin-1")})
    if ex.finished or ex.conn.closed:
        return
    if not ex.started:
        ex.respond(500, error_body(500, "internal error" if exc is not None else "the request was cancelled"))
    else:
        ex.abort()
