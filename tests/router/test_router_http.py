"""The router's own HTTP/1.1 server and worker connection pools, over raw sockets: pipelining, HTTP/1.0,
``Expect: 100-continue``, chunked request bodies, a slow reader of a long stream (reading from the worker
pauses and resumes), and a pooled connection the worker closed as a request went out."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from router_testkit import FakeWorker, RouterProc, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BODY = {"model": "stories260K", "prompt": "a b", "max_tokens": 2}


def post(rid: str, body: dict, version: str = "1.1", extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/{version}\r\nhost: r\r\ncontent-type: application/json\r\n"
            f"x-request-id: {rid}\r\ncontent-length: {len(data)}\r\n{extra}\r\n").encode() + data


def read_responses(sock: socket.socket, count: int, timeout: float = 10.0) -> list[tuple[bytes, bytes]]:
    """``count`` responses with a content-length: (head, body) each."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((head, buf[:length]))
        buf = buf[length:]
    return out


def dechunk(body: bytes) -> bytes:
    """The payload of a chunked HTTP body."""
    out, i = [], 0
    while True:
        end = body.index(b"\r\n", i)
        size = int(body[i:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        i = end + 2 + size + 2


@pytest.fixture(scope="module")
def router():
    with FakeWorker("mixed", ["--ttft-ms", "5", "--itl-ms", "0", "--num-tokens", "40000"]) as w, \
            RouterProc(["--worker", w.url, "--policy", "round_robin"]) as r:
        yield r


def test_pipelined_requests_are_answered_in_order(router):
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(b"".join(post(f"pipe-{i}", dict(BODY, max_tokens=1 + i)) for i in range(3)))
        answers = read_responses(s, 3)
    for i, (head, body) in enumerate(answers):
        assert head.startswith(b"HTTP/1.1 200") and f"x-request-id: pipe-{i}".encode() in head
        assert json.loads(body)["usage"]["completion_tokens"] == 1 + i


def test_http_1_0_client_gets_a_close_delimited_stream(router):
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(post("old", dict(BODY, stream=True, max_tokens=3), version="1.0"))
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert body.count(b"data: {") == 4 and body.endswith(b"data: [DONE]\n\n")


def test_expect_100_continue_and_a_chunked_body(router):
    data = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                  b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(data))
        s.settimeout(10)
        assert s.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(data)
        (head, body), = read_responses(s, 1)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"][0]["text"] == " Once upon"

    def pieces():  # no content-length: chunked
        yield data[:7]
        yield data[7:]

    r = httpx.post(router.url + "/v1/completions", content=pieces(), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Once upon"


def test_a_slow_reader_gets_a_long_stream_whole(router):
    """40,000 events (about 7 MB, more than the loopback socket buffers hold) read 16 KiB at a time with pauses:
    the router's writes back up, it stops reading from the worker until the client catches up, and resumes
    (twice in a run on the 2-core VM, seen in a debug build); nothing is lost or reordered."""
    body = dict(BODY, stream=True, max_tokens=40000)
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        s.sendall(post("slow", body))
        s.settimeout(30)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            data += s.recv(16384)
            time.sleep(0.002)
    events = [e for e in dechunk(data.split(b"\r\n\r\n", 1)[1]).split(b"\n\n") if e]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert len(texts) == 40000 + 1 and events[-1].endswith(b"data: [DONE]")
    words = [" Once", " upon", " a", " time", " there", " was", " little", " girl"]
    assert texts[:40000] == [words[i % 8] for i in range(40000)]


class ClosingWorker:
    """A mixed worker on loopback that answers one completion per connection, keeping it alive, and closes a
    connection that brings a second one without answering (a worker closing an idle connection as a request
    arrives on it)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.completions: list[str] = []
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        answered = 0
        while head := await reader.readuntil(b"\r\n\r\n"):
            lines = head.decode().split("\r\n")
            length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")), 0)
            await reader.readexactly(length)
            path = lines[0].split()[1]
            if path == "/v1/completions":
                if answered:
                    self.dropped += 1
                    writer.close()
                    return
                answered += 1
                rid = next(x.split(":", 1)[1].strip() for x in lines if x.lower().startswith("x-request-id"))
                self.completions.append(rid)
                payload = json.dumps({"id": rid, "object": "text_completion", "choices": [
                    {"index": 0, "text": " ok", "finish_reason": "length"}]}).encode()
            elif path == "/server_info":
                payload = json.dumps({"role": "mixed", "served_model_name": "stories260K"}).encode()
            else:
                payload = b'{"status": "ok"}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(payload), payload))
            await writer.drain()


def test_a_pooled_connection_closed_by_the_worker_gets_the_request_again():
    worker = ClosingWorker()
    with RouterProc(["--worker", f"http://127.0.0.1:{worker.port}", "--policy", "round_robin",
                     "--disable-retries", "--upstream-keepalive-secs", "30"]) as router:
        for i in range(3):
            r = httpx.post(router.url + "/v1/completions", json=BODY, headers={"x-request-id": f"stale-{i}"},
                           timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " ok", r.text
    # requests 2 and 3 went out on the pooled connection, which the worker closed unanswered; each was sent
    # again on a fresh connection (no retry: they are off), and each was answered once
    assert worker.dropped == 2 and worker.completions == ["stale-0", "stale-1", "stale-2"]


def test_refusals_for_size_keep_the_order_of_pipelined_answers(router):
    many = "".join(f"x-h{i}: v\r\n" for i in range(300))  # past 256 header fields
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(post("first", BODY) + post("second", BODY, extra=many))
        (head1, body1), (head2, body2) = read_responses(s, 2)
    assert head1.startswith(b"HTTP/1.1 200") and b"x-request-id: first" in head1
    assert head2.startswith(b"HTTP/1.1 431") and json.loads(body2)["error"]["code"] == \
        "request_header_fields_too_large"
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.sendall(b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nhost: r\r\n\r\n")
        (head, body), = read_responses(s, 1)
    assert head.startswith(b"HTTP/1.1 414") and json.loads(body)["error"]["type"] == "invalid_request_error"
