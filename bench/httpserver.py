"""A minimal HTTP/1.1 server on asyncio protocols, for fake workers in tests and benchmarks.

It parses requests straight from ``data_received`` (keep-alive, pipelining,
``Content-Length`` and ``chunked`` request bodies) and hands each one to an
async handler with a :class:`Responder` that can send a whole response or a
chunked stream (Server-Sent Events). It exists so the fake OpenAI server can
answer thousands of requests per second on one core with exact timing; it is
not a general web framework (no TLS, no HTTP/2, no ``Expect: 100-continue``).

The arrival time of each request (``time.monotonic()``, seconds) is taken when
its last byte is parsed, so handlers can schedule against monotonic deadlines.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Awaitable, Callable

from pd_cluster.common.openai_errors import openai_error_type

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024

_REASONS = {s.value: s.phrase for s in HTTPStatus}


@dataclass(slots=True)
class Request:
    """One parsed HTTP request.

    ``headers`` maps lower-cased names to values (the last one wins);
    ``arrival`` is ``time.monotonic()`` when the request was complete.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    arrival: float


Handler = Callable[[Request, "Responder"], Awaitable[None]]


class Responder:
    """Writes one response on a connection: either :meth:`send` once, or
    :meth:`start_stream`, any number of :meth:`write`, then :meth:`end_stream`.

    Writes after the peer went away are dropped; :attr:`closed` tells a
    streaming handler to stop early.
    """

    __slots__ = ("_proto", "_keep_alive", "started", "finished")

    def __init__(self, proto: "HttpProtocol", keep_alive: bool) -> None:
        self._proto = proto
        self._keep_alive = keep_alive
        self.started = False
        self.finished = False

    @property
    def closed(self) -> bool:
        return self._proto.transport is None

    def _head(self, status: int, headers: list[tuple[str, str]], extra: str) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers)
        if not self._keep_alive:
            lines.append("connection: close\r\n")
        lines.append(extra)
        return "".join(lines).encode("latin-1")

    def send(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        """Send a complete response with ``Content-Length``."""
        self.started = self.finished = True
        head = self._head(status, headers, f"content-length: {len(body)}\r\n\r\n")
        self._proto.write(head + body)

    def start_stream(self, status: int, headers: list[tuple[str, str]], first: bytes = b"") -> None:
        """Send the status line and headers of a chunked response, and optionally a first chunk."""
        self.started = True
        head = self._head(status, headers, "transfer-encoding: chunked\r\n\r\n")
        self._proto.write(head + (_chunk(first) if first else b""))

    def write(self, data: bytes) -> None:
        """Send one chunk of a streamed response (empty data is skipped)."""
        if data:
            self._proto.write(_chunk(data))

    def end_stream(self, last: bytes = b"") -> None:
        """Send an optional last chunk and the terminating zero-length chunk."""
        self.finished = True
        self._proto.write((_chunk(last) if last else b"") + b"0\r\n\r\n")

    def abort(self) -> None:
        """Close the connection at once (a server crash as the client sees it)."""
        self._proto.abort()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _BadRequest(Exception):
    pass


class HttpProtocol(asyncio.Protocol):
    """One client connection: parses requests and runs them one at a time, in order."""

    def __init__(self, handler: Handler, connections: set["HttpProtocol"]) -> None:
        self._handler = handler
        self._connections = connections
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._pending: deque[tuple[Request, bool]] = deque()
        self._busy = False

    # asyncio callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._connections.discard(self)
        self._pending.clear()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            while True:
                parsed = self._parse_one()
                if parsed is None:
                    break
                self._pending.append(parsed)
        except _BadRequest as exc:
            self._pending.clear()
            body = json.dumps({"error": {"message": str(exc), "type": openai_error_type(400), "param": None,
                                         "code": "invalid_http_request"}})
            self.write(
                f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}".encode()
            )
            self.close()
            return
        self._run_next()

    # parsing ---------------------------------------------------------------------------
    def _parse_one(self) -> tuple[Request, bool] | None:
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEADER_BYTES:
                raise _BadRequest("request headers too large")
            return None
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            raise _BadRequest("malformed request line") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _BadRequest("malformed header line")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            got = _parse_chunked(buf, start)
            if got is None:
                return None
            body, consumed = got
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest("bad content-length") from None
            if length < 0 or length > MAX_BODY_BYTES:
                raise _BadRequest("bad content-length")
            if len(buf) < start + length:
                return None
            body, consumed = bytes(buf[start : start + length]), start + length
        del buf[:consumed]
        path, _, query = target.partition("?")
        conn = headers.get("connection", "").lower()
        keep_alive = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        return Request(method, path, query, headers, body, time.monotonic()), keep_alive

    # running ---------------------------------------------------------------------------
    def _run_next(self) -> None:
        if self._busy or not self._pending or self.transport is None:
            return
        req, keep_alive = self._pending.popleft()
        self._busy = True
        asyncio.get_running_loop().create_task(self._run(req, keep_alive))

    async def _run(self, req: Request, keep_alive: bool) -> None:
        resp = Responder(self, keep_alive)
        try:
            await self._handler(req, resp)
        except Exception as exc:  # a handler bug must not hang the client
            if not resp.started:
                msg = f"internal error: {type(exc).__name__}"
                resp.send(500, msg.encode(), [("content-type", "text/plain")])
            keep_alive = False
        self._busy = False
        if not resp.finished or not keep_alive:
            self.close()
        else:
            self._run_next()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _parse_chunked(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at ``pos``; None when incomplete."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        except ValueError:
            raise _BadRequest("bad chunk size") from None
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", pos - 2)
            return (bytes(out), end + 4) if end >= 0 else None
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos : pos + size]
        if len(out) > MAX_BODY_BYTES:
            raise _BadRequest("request body too large")
        pos += size + 2


class HttpServer:
    """Serves ``handler`` on ``host:port`` (port 0 picks a free one; see :attr:`port`)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self._handler = handler
        self._host = host
        self._port = port
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[HttpProtocol] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpProtocol(self._handler, self.connections),
            self._host,
            self._port,
            reuse_address=True,
            backlog=4096,
        )

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.sockets[0].getsockname()[1]

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.close()
            await self._server.wait_closed()
