"""Connections to the workers: one keep-alive pool per worker for generate requests, one aiohttp session for probes.

**Data path** (`UpstreamPool`): HTTP/1.1 connections on asyncio protocols with httptools' response parser.
A request is written in one ``transport.write``; the response is parsed in ``data_received`` and delivered
to a `Reply` by callbacks, so a streamed answer is relayed chunk by chunk from the protocol callback
itself, without waking a coroutine per chunk (``router.relay``). A generic client (aiohttp: a request
object, a response object, a stream reader and a coroutine step per read) cost about as much CPU per
request as all the rest of the router (``docs/perf/router.md``).

Pooled connections idle for ``upstream_keepalive_secs`` are closed and never reused; keeping that below
the workers' own keep-alive timeout (uvicorn: 5 s) means the router never writes a request into a
connection the worker is closing, and a router that idles for hours (behind NATs or load balancers that
silently drop idle flows) opens fresh connections instead of reusing dead ones. If a reused connection
still closes before answering a single byte (the worker closed it as the request went out), the request
is written once more on a fresh connection: the worker never read it.

Every byte from a worker stamps its pool's `UpstreamPool.last_seen`: the health monitor reads it to tell
a worker that is slow to answer a probe but still streams tokens (busy) from one that is gone (dead).

**Probes** (``control``): health checks, load polls and KV event polls go through an aiohttp session of
their own, so probe traffic never waits behind the data path.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import httptools

from pd_cluster.router.config import LimitsConfig


class UpstreamError(Exception):
    """A request to a worker failed. ``stage``: ``connect`` (no connection), ``head`` (closed before the
    status line), ``body`` (closed or malformed after it). ``refused``: the connection was refused or reset
    (the worker is gone); ``timed_out``: it could not be opened in time (slow, not gone)."""

    def __init__(self, stage: str, detail: str, refused: bool = False, timed_out: bool = False) -> None:
        super().__init__(detail)
        self.stage = stage
        self.refused = refused
        self.timed_out = timed_out


class Reply:
    """One response from a worker, filled in by `UpstreamConn`'s callbacks.

    ``done``: a future set to True when the response is complete, or to an `UpstreamError`.
    ``on_head(reply)``: called once the status and headers are in; it may set ``on_chunk(data)``, which then
    receives each piece of the body (else the pieces collect in ``chunks``).
    """

    __slots__ = ("done", "status", "headers", "chunks", "on_head", "on_chunk", "complete", "conn")

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_head: Callable[["Reply"], None] | None = None) -> None:
        self.done: asyncio.Future[bool] = loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.on_head = on_head
        self.on_chunk: Callable[[bytes], None] | None = None
        self.complete = False
        self.conn: UpstreamConn | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def body(self) -> bytes:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)

    def abort(self) -> None:
        """Give up on the response: the connection is closed, so the worker sees the client leave."""
        conn = self.conn
        if conn is not None and not self.complete:
            conn.abort()

    def _fail(self, error: UpstreamError) -> None:
        if not self.done.done():
            self.done.set_exception(error)


class UpstreamConn(asyncio.Protocol):
    """One connection to a worker; carries one request at a time."""

    def __init__(self, pool: "UpstreamPool") -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.reply: Reply | None = None
        self.request = b""          # kept until the first byte of the answer (to resend on a stale connection)
        self.reused = False
        self.closed = False
        self.idle_since = 0.0
        self._headers: list[tuple[bytes, bytes]] = []
        self._got = 0               # bytes of the current answer
        self._pieces: list[bytes] = []  # body pieces of one read, delivered together

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def begin(self, reply: Reply, request: bytes) -> None:
        self.reply, self.request, self._got, self._headers = reply, request, 0, []
        reply.conn = self
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.pool.last_seen = time.monotonic()
        self._got += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            reply, self._pieces = self.reply, []
            self.abort()
            if reply is not None:
                reply._fail(UpstreamError("body" if reply.status else "head", f"malformed answer: {exc}"))
            return
        if self._pieces:
            self._deliver()

    def _deliver(self) -> None:
        """Hand the body pieces of this read to the reply's relay at once (one write to the client per read,
        not one per chunk of the worker's chunked encoding)."""
        pieces, self._pieces = self._pieces, []
        reply = self.reply
        if reply is not None and reply.on_chunk is not None:
            reply.on_chunk(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        reply = self.reply
        if reply is None:
            return
        self.request = b""
        reply.status = self.parser.get_status_code()
        reply.headers = self._headers
        if reply.on_head is not None:
            reply.on_head(reply)

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        if reply is not None:
            if reply.on_chunk is not None:
                self._pieces.append(body)
            else:
                reply.chunks.append(body)

    def on_message_complete(self) -> None:
        if self._pieces:
            self._deliver()
        reply, self.reply = self.reply, None
        if reply is None:
            return
        reply.complete = True
        if self.parser.should_keep_alive() and not self.closed:
            self.pool.release(self)
        else:
            self.close()
        if not reply.done.done():
            reply.done.set_result(True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        reply, self.reply = self.reply, None
        if reply is None or reply.complete:
            return
        if reply.status and _until_close(reply.headers):  # a body delimited by the end of the connection
            reply.complete = True
            if not reply.done.done():
                reply.done.set_result(True)
        elif self.reused and self._got == 0 and self.request:
            self.pool.resend(reply, self.request)  # closed as it was reused: the worker never read it
        else:
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "the worker closed the connection"
            reply._fail(UpstreamError("body" if reply.status else "head", why,
                                      refused=isinstance(exc, ConnectionResetError)))

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
        self.pool.discard(self)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()
        self.pool.discard(self)

    def pause(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.resume_reading()


def _until_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return not any(k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower())
                   for k, v in headers)


class UpstreamPool:
    """Keep-alive connections to one worker (``http(s)://host:port``).

    ``head_lines``: header lines sent with every request (the internal key), CRLF-terminated.
    """

    def __init__(self, url: str, keepalive_secs: float, connect_timeout_secs: float,
                 head_lines: bytes = b"") -> None:
        parts = urlsplit(url)
        self.url = url
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.keepalive_secs = keepalive_secs
        self.connect_timeout_secs = connect_timeout_secs
        self.head_lines = b"host: " + parts.netloc.encode() + b"\r\n" + head_lines
        self.idle: list[UpstreamConn] = []
        self.last_seen = float("-inf")
        self.closed = False

    def frame(self, path: bytes, headers: bytes, body: bytes) -> bytes:
        """A POST of ``body`` to ``path`` with the extra header lines ``headers`` (CRLF-terminated)."""
        return b"".join((b"POST ", path, b" HTTP/1.1\r\n", self.head_lines, headers,
                         b"content-length: %d\r\n\r\n" % len(body), body))

    def send_pooled(self, request: bytes, reply: Reply) -> bool:
        """Write ``request`` (see `frame`) on a pooled connection if one is idle; False: call `send`."""
        conn = self._take()
        if conn is None:
            return False
        conn.begin(reply, request)
        return True

    async def send(self, request: bytes, reply: Reply) -> None:
        """Write ``request`` (see `frame`) on a pooled or a new connection; its answer goes to ``reply``.

        Raises:
            UpstreamError: no connection could be opened (stage ``connect``).
        """
        conn = self._take()
        if conn is None:
            conn = await self._connect()
        conn.begin(reply, request)

    def resend(self, reply: Reply, request: bytes) -> None:
        asyncio.ensure_future(self._resend(reply, request))

    async def _resend(self, reply: Reply, request: bytes) -> None:
        try:
            conn = await self._connect()
        except UpstreamError as exc:
            reply._fail(exc)
            return
        if reply.done.done():  # the attempt gave up meanwhile
            conn.close()
        else:
            conn.begin(reply, request)

    def _take(self) -> UpstreamConn | None:
        idle = self.idle
        if not idle:
            return None
        too_old = time.monotonic() - self.keepalive_secs
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= too_old:
                conn.reused = True
                return conn
            conn.close()
        return None

    async def _connect(self) -> UpstreamConn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: UpstreamConn(self), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None), self.connect_timeout_secs)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            raise UpstreamError("connect", f"{type(exc).__name__}: {exc}",
                                refused=isinstance(exc, (ConnectionRefusedError, ConnectionResetError)),
                                timed_out=isinstance(exc, (asyncio.TimeoutError, TimeoutError))) from None
        return conn

    def release(self, conn: UpstreamConn) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def discard(self, conn: UpstreamConn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def sweep(self, now: float) -> None:
        """Close idle connections past the keep-alive time."""
        too_old = now - self.keepalive_secs
        for conn in [c for c in self.idle if c.idle_since < too_old]:
            conn.close()

    def close(self) -> None:
        self.closed = True
        for conn in list(self.idle):
            conn.close()


class Upstreams:
    """The pools of the data path (one per worker URL) and the probe session; open inside the running loop.

    ``internal_api_key``: the cluster's internal key, sent on every worker call (``X-PD-Internal-Key``).
    """

    def __init__(self, limits: LimitsConfig, internal_api_key: str | None = None) -> None:
        self._limits = limits
        self._headers = {"X-PD-Internal-Key": internal_api_key} if internal_api_key else None
        self._head_lines = b"x-pd-internal-key: " + internal_api_key.encode() + b"\r\n" if internal_api_key else b""
        self._pools: dict[str, UpstreamPool] = {}
        self._control: aiohttp.ClientSession | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        lim = self._limits
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=lim.upstream_keepalive_secs,
                                         ttl_dns_cache=10, enable_cleanup_closed=True)
        self._control = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=lim.connect_timeout_secs),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), headers=self._headers,
            skip_auto_headers=("User-Agent", "Accept-Encoding"), raise_for_status=False)
        self._sweeper = asyncio.ensure_future(self._sweep_loop())

    def pool(self, url: str) -> UpstreamPool:
        """The data-path pool of the worker at ``url`` (made on first use)."""
        pool = self._pools.get(url)
        if pool is None:
            lim = self._limits
            pool = self._pools[url] = UpstreamPool(url, lim.upstream_keepalive_secs, lim.connect_timeout_secs,
                                                   self._head_lines)
        return pool

    def last_seen(self, url: str) -> float:
        """``time.monotonic()`` of the last byte the worker at ``url`` sent on the data path (-inf: never)."""
        pool = self._pools.get(url)
        return pool.last_seen if pool is not None else float("-inf")

    def forget(self, url: str) -> None:
        """A worker left the registry: close its idle connections."""
        pool = self._pools.pop(url, None)
        if pool is not None:
            pool.close()

    @property
    def control(self) -> aiohttp.ClientSession:
        if self._control is None:
            raise RuntimeError("upstream sessions are not started")
        return self._control

    async def _sweep_loop(self) -> None:
        period = max(0.05, min(1.0, self._limits.upstream_keepalive_secs / 2))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for pool in list(self._pools.values()):
                pool.sweep(now)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for pool in self._pools.values():
            pool.close()
        if self._control is not None:
            await self._control.close()
        self._control = None
