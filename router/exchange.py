"""One HTTP request on a client connection and the response written for it (no framework on the hot path).

An `Exchange` is what `router.http_server` hands a handler: the parsed request (method, path, raw
header pairs, body) and the calls that write the response straight onto the connection's transport:
`respond` (a whole response with ``content-length``) or `start` / `write` / `end` (a chunked stream, or a
close-delimited one for HTTP/1.0 clients). Each response is one ``transport.write`` where it can be, so a
short request costs the router two system calls on the client side (one read, one write).

Flow control: a stream that writes faster than the client reads pauses the connection's writes
(`paused`); a relay registers `on_resume` to be told when it may go on (``router.relay`` stops reading
from the worker meanwhile, so backpressure reaches the worker instead of piling up in the router).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol

Headers = list[tuple[bytes, bytes]]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"


def valid_request_id(value: bytes | None) -> str | None:
    """A client-given request id if it is short and plain (else ``None``)."""
    if not value:
        return None
    text = value.decode("latin-1")
    return text if _REQUEST_ID.match(text) else None


def bearer_ok(value: bytes | None, key: bytes) -> bool:
    """True when an ``Authorization`` header value is ``Bearer <key>``, compared in constant time."""
    if not value or value[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(value[7:].strip(), key)


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Status\r\n".encode()


class DateHeader:
    """The ``date`` header line, formatted at most once per second (RFC 9110 wants one on every response)."""

    line = b""
    _second = -1

    @classmethod
    def get(cls) -> bytes:
        now = int(time.time())
        if now != cls._second:
            cls._second = now
            cls.line = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return cls.line


class Connection(Protocol):
    """What an `Exchange` needs of its client connection (`router.http_server.HttpConnection` is one); declared
    here so that this module does not import the server that imports it."""

    closed: bool
    write_paused: bool
    resume_callbacks: list[Callable[[], None]]

    def write(self, data: bytes) -> None: ...

    def exchange_done(self, ex: Exchange) -> None: ...

    def close_after_exchange(self, ex: Exchange, abort: bool = False) -> None: ...


class Exchange:
    """A request and its response; written to only from the event loop.

    Attributes: ``method`` (str), ``path`` (bytes, no query), ``query`` (bytes), ``headers`` (lower-case
    name, value pairs as received), ``body`` (bytes; None when refused before it was read),
    ``too_large`` (the body passed the limit), ``arrived`` (``time.perf_counter()`` when complete).
    ``on_lost``: called once if the client disconnects before the response ended.
    """

    __slots__ = ("conn", "method", "path", "query", "headers", "body", "too_large", "refusal", "arrived",
                 "keep_alive", "http11", "started", "finished", "chunked", "on_lost", "task")

    def __init__(self, conn: Connection, method: str, path: bytes, query: bytes, headers: Headers,
                 body: bytes | None, keep_alive: bool, http11: bool) -> None:
        self.conn = conn
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.too_large = False
        self.refusal: tuple[int, str] | None = None  # the server answers it itself (431)
        self.arrived = time.perf_counter()
        self.keep_alive = keep_alive
        self.http11 = http11
        self.started = False
        self.finished = False
        self.chunked = False
        self.on_lost: Callable[[], None] | None = None
        self.task: Any = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case bytes), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def client_gone(self) -> bool:
        return self.conn.closed

    # ---- writing ---------------------------------------------------------------------------------------------
    def _head(self, status: int, extra: Iterable[tuple[bytes, bytes]], framing: bytes) -> bytes:
        parts = [status_line(status), DateHeader.get(), framing]
        for name, value in extra:
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def respond(self, status: int, body: bytes, content_type: bytes = b"application/json",
                extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """The whole response, with ``content-length``; ends the exchange."""
        if self.started:
            raise RuntimeError("the response has started")
        self.started = True
        head = self._head(status, extra, b"content-type: " + content_type + b"\r\ncontent-length: "
                          + str(len(body)).encode() + b"\r\n")
        if self.method == "HEAD":
            body = b""
        self.conn.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.conn.write(body)
        self._finish()

    def start(self, status: int, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """The status line and headers of a streamed response (chunked for HTTP/1.1 clients)."""
        if self.started:
            raise RuntimeError("the response has started")
        self.started = True
        self.chunked = self.http11
        if not self.http11:
            self.keep_alive = False  # an HTTP/1.0 stream ends when the connection closes
        self.conn.write(self._head(status, headers, b"transfer-encoding: chunked\r\n" if self.chunked else b""))

    def write(self, data: bytes) -> None:
        """One piece of a started stream (nothing for empty ``data``)."""
        if data and not self.finished:
            self.conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def end(self, data: bytes = b"") -> None:
        """The last piece of a started stream; ends the exchange."""
        if self.finished:
            return
        if self.chunked:
            self.conn.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data:
            self.conn.write(data)
        self._finish()

    def abort(self) -> None:
        """End a started response abnormally: the connection is closed without the terminating chunk."""
        if not self.finished:
            self.finished = True
            self.conn.close_after_exchange(self, abort=True)

    def _finish(self) -> None:
        self.finished = True
        self.conn.exchange_done(self)

    # ---- flow control ---------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """The client is not reading fast enough: hold further writes."""
        return self.conn.write_paused

    def on_resume(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the client's connection takes writes again."""
        self.conn.resume_callbacks.append(callback)


def running_loop(ex: Exchange) -> asyncio.AbstractEventLoop:
    """The running event loop, from the task serving `ex` (``asyncio.get_running_loop()`` makes a ``getpid``
    system call each time; the router serves every exchange on one loop)."""
    task = ex.task
    return task.get_loop() if task is not None else asyncio.get_running_loop()
