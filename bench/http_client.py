"""A lean HTTP/1.1 client for streamed responses, on asyncio protocols.

pd-bench needs two things a general client does not give it: low and steady
CPU cost per request (so one core can keep up with hundreds of requests per
second without delaying its own sends), and a timestamp taken the moment the
bytes are handed over by the event loop, not when a coroutine later resumes.
So each response body is pushed straight from ``data_received`` into a
:class:`BodySink`, and the sending coroutine only awaits one future per
request. The arrival time given with the bytes comes from an
:class:`ArrivalClock`: on a ``pd_cluster.bench.precise_loop`` event loop it is the moment
the loop learnt the socket was readable,
so processing other streams that became readable at the same moment does not
make a stream's timestamp late; otherwise it is ``time.monotonic()`` at the top
of ``data_received``.

Supported: keep-alive connection pooling, ``Content-Length``, ``chunked`` and
read-until-close bodies, 1xx responses skipped, TLS (``https://``), a total
timeout per request, and one retry on a fresh connection when a reused idle
connection turns out to be closed before any byte of the answer arrived.
Not supported: proxies, redirects, HTTP/2, compressed bodies.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from pd_cluster.bench.precise_loop import PreciseSelector, new_event_loop

_MAX_HEAD = 64 * 1024


class ArrivalClock:
    """Arrival times of received bytes: the loop's ``ready_at`` stamp when it runs on a
    :class:`bench.precise_loop.PreciseSelector`, else ``time.monotonic()`` now."""

    def __init__(self) -> None:
        self.selector: PreciseSelector | None = None

    def now(self) -> float:
        return self.selector.ready_at if self.selector is not None else time.monotonic()

    def new_loop(self) -> asyncio.AbstractEventLoop:
        """A precise event loop (see ``pd_cluster.bench.precise_loop``) whose stamps this clock reads."""
        loop, self.selector = new_event_loop()
        return loop


class BodySink(Protocol):
    """Receives one response: its status and headers, then body bytes with their arrival time."""

    def on_head(self, status: int, headers: dict[str, str]) -> None: ...
    def on_body(self, data: bytes, now: float) -> None: ...


class HttpError(Exception):
    """A transport-level failure; ``reason`` is a short category, ``got_bytes`` whether any answer came."""

    def __init__(self, reason: str, message: str, got_bytes: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.got_bytes = got_bytes


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, pool: "HttpPool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset(None, None)

    def _reset(self, sink: BodySink | None, fut: asyncio.Future | None) -> None:
        self.sink, self.fut = sink, fut
        self.buf = bytearray()
        self.state = "head"
        self.cstate = "size"
        self.remaining = 0
        self.keep_alive = True
        self.got_bytes = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        fut = self.fut
        if fut is not None and not fut.done():
            if self.state == "until_close":
                fut.set_result(None)
            else:
                reason = "disconnected mid-stream" if self.got_bytes else "disconnected"
                fut.set_exception(HttpError(reason, f"server closed the connection ({exc or 'EOF'})",
                                            self.got_bytes))

    def start(self, request: bytes, sink: BodySink, fut: asyncio.Future) -> None:
        self._reset(sink, fut)
        assert self.transport is not None
        self.transport.write(request)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        now = self.pool.clock.now()
        if self.fut is None or self.fut.done():
            return
        self.got_bytes = True
        try:
            self._parse(data, now)
        except ValueError as exc:
            self.fut.set_exception(HttpError("bad response", str(exc), True))
            self.abort()

    def _parse(self, data: bytes, now: float) -> None:
        if self.state == "head":
            self.buf += data
            while self.state == "head":
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > _MAX_HEAD:
                        raise ValueError("response headers too large")
                    return
                head = bytes(self.buf[:end])
                del self.buf[: end + 4]
                self._head(head)
            data = bytes(self.buf)
            self.buf = bytearray()
            if self.state == "length" and self.remaining <= 0:
                self._finish()
                return
            if not data:
                return
        if self.state == "chunked":
            self._chunked(data, now)
        elif self.state == "length":
            take = data[: self.remaining]
            self.remaining -= len(take)
            if take:
                self.sink.on_body(take, now)
            if self.remaining <= 0:
                self._finish()
        elif self.state == "until_close":
            self.sink.on_body(data, now)

    def _head(self, head: bytes) -> None:
        """Parses a status line and headers and picks the body framing (a 1xx keeps reading heads)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        self.keep_alive = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        self.sink.on_head(status, headers)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            self.state = "chunked"
        elif "content-length" in headers:
            self.state, self.remaining = "length", int(headers["content-length"])
        elif status in (204, 304):
            self.state, self.remaining = "length", 0
        else:
            self.state, self.keep_alive = "until_close", False

    def _chunked(self, data: bytes, now: float) -> None:
        """Chunked transfer coding (RFC 9112 section 7.1), fed in arbitrary pieces."""
        buf = self.buf
        buf += data
        pos, n, out = 0, len(buf), []
        while True:
            st = self.cstate
            if st == "size":
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(bytes(buf[pos:eol]).split(b";")[0].strip(), 16)
                pos = eol + 2
                self.cstate, self.remaining = ("data", size) if size else ("trailer", 0)
            elif st == "data":
                take = min(self.remaining, n - pos)
                if take <= 0:
                    break
                out.append(bytes(buf[pos:pos + take]))
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.cstate = "crlf"
            elif st == "crlf":
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ValueError("bad chunk terminator")
                pos += 2
                self.cstate = "size"
            elif st == "trailer":
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                empty, pos = eol == pos, eol + 2
                if empty:
                    self.cstate = "done"
                    break
            else:
                break
        del buf[:pos]
        if out:
            self.sink.on_body(b"".join(out), now)
        if self.cstate == "done":
            self._finish()

    def _finish(self) -> None:
        fut = self.fut
        self.fut = self.sink = None
        self.state = "idle"
        if fut is not None and not fut.done():
            fut.set_result(None)
        if self.keep_alive and not self.closed:
            self.pool.release(self)
        else:
            self.abort()


@dataclass(slots=True)
class Pending:
    """A request written on ``conn`` whose answer completes ``fut``; ``deadline`` in loop time."""

    conn: _Conn
    fut: asyncio.Future
    timer: asyncio.TimerHandle
    reused: bool
    deadline: float


class HttpPool:
    """Keep-alive connections to one ``scheme://host:port`` (opened on demand, reused when idle)."""

    def __init__(self, base_url: str, clock: ArrivalClock | None = None) -> None:
        self.clock = clock or ArrivalClock()
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {base_url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        default_port = (u.scheme == "https" and self.port == 443) or (u.scheme == "http" and self.port == 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self._idle: deque[_Conn] = deque()
        self._all: set[_Conn] = set()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl)
        except OSError as exc:
            raise HttpError("connection error", f"cannot connect to {self.host}:{self.port}: {exc}", False) from exc
        self._all.add(conn)
        return conn

    def release(self, conn: _Conn) -> None:
        self._idle.append(conn)

    def request_bytes(self, method: str, path: str, headers: str, body: bytes) -> bytes:
        """``headers`` are ``Name: value\\r\\n`` lines (no Host or Content-Length)."""
        return (f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n{headers}"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                return c
            self._all.discard(c)
        return None

    def _start(self, conn: _Conn, request: bytes, sink: BodySink, deadline: float, reused: bool) -> Pending:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        timer = loop.call_at(deadline, _expire, fut, conn, deadline)
        conn.start(request, sink, fut)
        return Pending(conn, fut, timer, reused, deadline)

    def try_start(self, request: bytes, sink: BodySink, timeout_s: float) -> Pending | None:
        """Write ``request`` now on an idle connection (no await); None when none is idle."""
        conn = self._take_idle()
        if conn is None:
            return None
        return self._start(conn, request, sink, asyncio.get_running_loop().time() + timeout_s, True)

    async def _start_new(self, request: bytes, sink: BodySink, deadline: float) -> Pending:
        loop = asyncio.get_running_loop()
        try:
            conn = await asyncio.wait_for(self._connect(), max(0.001, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise HttpError("timeout", "no connection within the request timeout", False) from None
        return self._start(conn, request, sink, deadline, False)

    async def wait(self, p: Pending, request: bytes, sink: BodySink) -> None:
        """Wait for the answer of a started request; a reused connection found closed before
        any byte of the answer is retried once on a new connection. Raises :class:`HttpError`."""
        try:
            await p.fut
            return
        except HttpError as exc:
            if not (p.reused and not exc.got_bytes and exc.reason == "disconnected"):
                raise
        finally:
            p.timer.cancel()
            if p.conn.closed:
                self._all.discard(p.conn)
        retry = await self._start_new(request, sink, p.deadline)
        try:
            await retry.fut
        finally:
            retry.timer.cancel()
            if retry.conn.closed:
                self._all.discard(retry.conn)

    async def send(self, request: bytes, sink: BodySink, timeout_s: float) -> None:
        """Send ``request`` and feed the answer to ``sink``; returns when the body is complete.

        Raises :class:`HttpError` (reason ``timeout``, ``connection error``,
        ``disconnected``, ``disconnected mid-stream`` or ``bad response``).
        """
        p = self.try_start(request, sink, timeout_s)
        if p is None:
            p = await self._start_new(request, sink, asyncio.get_running_loop().time() + timeout_s)
        await self.wait(p, request, sink)

    def close(self) -> None:
        for c in list(self._all):
            c.abort()
        self._all.clear()
        self._idle.clear()


def _expire(fut: asyncio.Future, conn: _Conn, deadline: float) -> None:
    if not fut.done():
        fut.set_exception(HttpError("timeout", "no complete answer within the request timeout", conn.got_bytes))
        conn.abort()
