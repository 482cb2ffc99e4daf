"""The lean HTTP/1.1 client: framing, keep-alive reuse, stale-connection retry, timeouts."""

from __future__ import annotations

import asyncio

import pytest

from pd_cluster.bench.http_client import HttpError, HttpPool

pytestmark = pytest.mark.timeout(60)


class Sink:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.pieces = 0

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers

    def on_body(self, data: bytes, now: float) -> None:
        self.body += data
        self.pieces += 1


async def _serve(script):
    """A raw TCP server on loopback that answers each request with ``script(n, writer)``."""
    conns = []
    count = 0

    async def handle(reader, writer):
        nonlocal count
        conns.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                await reader.readexactly(length)
                count += 1
                if not await script(count, writer):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port, conns, lambda: count


def _run(coro):
    return asyncio.run(coro)


def test_chunked_body_split_at_every_byte_is_reassembled():
    body = b"data: one\n\n" * 3 + b"data: [DONE]\n\n"
    chunks = [body[:5], body[5:20], body[20:]]
    wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    wire += b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nx-trailer: 1\r\n\r\n"

    async def script(n, w):
        for i in range(len(wire)):  # one byte per write, with pauses so they arrive apart
            w.write(wire[i:i + 1])
            if i % 7 == 0:
                await w.drain()
                await asyncio.sleep(0)
        await w.drain()
        return True

    async def main():
        server, port, _, count = await _serve(script)
        pool = HttpPool(f"http://127.0.0.1:{port}")
        sinks = [Sink(), Sink()]
        for s in sinks:
            await pool.send(pool.request_bytes("POST", "/x", "", b"{}"), s, 10)
        pool.close()
        server.close()
        return sinks, count()

    sinks, n = _run(main())
    assert n == 2
    for s in sinks:
        assert s.status == 200 and s.body == body and s.pieces > 1


def test_content_length_and_keep_alive_reuse_one_connection():
    async def script(n, w):
        payload = b'{"n": %d}' % n
        w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
        await w.drain()
        return True

    async def main():
        server, port, conns, count = await _serve(script)
        pool = HttpPool(f"http://127.0.0.1:{port}/prefix/")
        out = []
        for _ in range(5):
            s = Sink()
            await pool.send(pool.request_bytes("POST", "/v1/completions", "", b"{}"), s, 10)
            out.append((s.status, s.body))
        pool.close()
        server.close()
        return out, len(conns)

    out, nconn = _run(main())
    assert out == [(503, b'{"n": %d}' % i) for i in range(1, 6)]
    assert nconn == 1


def test_read_until_close_body():
    async def script(n, w):
        w.write(b"HTTP/1.0 200 OK\r\n\r\nhello ")
        await w.drain()
        w.write(b"world")
        await w.drain()
        return False  # closes the connection: the end of the body

    async def main():
        server, port, _, _ = await _serve(script)
        pool = HttpPool(f"http://127.0.0.1:{port}")
        s = Sink()
        await pool.send(pool.request_bytes("GET", "/", "", b""), s, 10)
        pool.close()
        server.close()
        return s

    s = _run(main())
    assert s.status == 200 and s.body == b"hello world"


def test_stale_idle_connection_is_retried_once_on_a_new_one():
    async def script(n, w):
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await w.drain()
        return True

    async def main():
        server, port, conns, count = await _serve(script)
        pool = HttpPool(f"http://127.0.0.1:{port}")
        await pool.send(pool.request_bytes("GET", "/", "", b""), Sink(), 10)
        conns[0].close()  # the server drops the idle connection; the client has not seen it yet
        s = Sink()
        await pool.send(pool.request_bytes("GET", "/", "", b""), s, 10)
        pool.close()
        server.close()
        return s, len(conns)

    s, nconn = _run(main())
    assert s.status == 200 and s.body == b"ok" and nconn == 2


def test_timeout_and_connection_errors_have_reasons():
    async def script(n, w):
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await asyncio.sleep(5)
        return True

    async def main():
        server, port, _, _ = await _serve(script)
        pool = HttpPool(f"http://127.0.0.1:{port}")
        with pytest.raises(HttpError) as slow:
            await pool.send(pool.request_bytes("GET", "/", "", b""), Sink(), 0.3)
        pool.close()
        server.close()
        await server.wait_closed()
        dead = HttpPool(f"http://127.0.0.1:{port}")
        with pytest.raises(HttpError) as refused:
            await dead.send(dead.request_bytes("GET", "/", "", b""), Sink(), 5)
        return slow.value, refused.value

    slow, refused = _run(main())
    assert slow.reason == "timeout" and slow.got_bytes
    assert refused.reason == "connection error"


def test_server_closing_mid_body_is_a_mid_stream_disconnect():
    async def script(n, w):
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        return False

    async def main():
        server, port, _, _ = await _serve(script)
        pool = HttpPool(f"http://127.0.0.1:{port}")
        s = Sink()
        with pytest.raises(HttpError) as err:
            await pool.send(pool.request_bytes("GET", "/", "", b""), s, 5)
        pool.close()
        server.close()
        return s, err.value

    s, err = _run(main())
    assert s.body == b"hello" and err.reason == "disconnected mid-stream"
