"""A client that closes its connection right after ``data: [DONE]`` got the whole answer: the router counts the
request as 200, not 499, whether or not it tracks the stream for migration. The worker here sends ``[DONE]`` and
only 0.5 s later the end of its chunked body, so the client's close always comes first (with real workers the two
race)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from router_testkit import RouterProc, metric_value

pytestmark = pytest.mark.slow  # starts the router

EVENTS = [{"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
           "choices": [{"index": 0, "text": " Once", "token_ids": [7], "logprobs": None, "finish_reason": None}]},
          {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": "", "token_ids": [], "logprobs": None, "finish_reason": "length"}]}]


class LateEndWorker:
    """A worker whose streams end with ``[DONE]``, then, 0.5 s later, the chunked body's last chunk."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()  # runs in a daemon thread until the test process ends
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._serve, sock=self.sock))
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                               if line.startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if not head.startswith(b"POST "):
                    body = b'{"status": "ok"}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    continue
                data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b"data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
                             b"\r\n\r\n%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                await asyncio.sleep(0.5)
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def stream_and_close(url: str) -> bytes:
    """A streamed completion over a raw socket, closed as soon as ``[DONE]`` is in."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once", "max_tokens": 2, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: [DONE]" not in got:
            piece = s.recv(65536)
            assert piece, got
            got += piece
    return got


@pytest.mark.parametrize("migration", [True, False], ids=["tracked", "raw"])
def test_a_client_that_closes_after_done_is_counted_200(migration):
    worker = LateEndWorker()
    flags = ["--worker", worker.url, "--policy", "round_robin", "--log-level", "warning"]
    with RouterProc(flags + ([] if migration else ["--migration-limit", "0"])) as router:
        for _ in range(3):
            assert b" Once" in stream_and_close(router.url)
        text = ""
        for _ in range(40):  # the router counts a request once its attempt is over
            text = router.metrics()
            if metric_value(text, "pd_router_requests_total") >= 3:
                break
            time.sleep(0.1)
        assert metric_value(text, "pd_router_requests_total", status="499") == 0
        assert metric_value(text, "pd_router_requests_total", status="200") == 3
