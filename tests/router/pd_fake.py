"""A PD-aware fake worker for router tests: ``pd_cluster.bench.fake_server`` plus the prefill check.

A fake decode worker here contacts the prefill worker named in
``X-PD-Prefill-Url`` (``GET /health``) before generating, and answers 502
when it cannot reach it, as a real decode worker does when its prefill died.
Without the header it answers 400. Run as
``python -m tests.router.pd_fake --port N --role decode ...`` (the flags of
``pd_cluster.bench.fake_server``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from urllib.parse import urlsplit

from pd_cluster.bench.fake_server import FakeServer, parse_args
from pd_cluster.bench.httpserver import HttpServer, Request, Responder

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


async def prefill_reachable(url: str, timeout: float = 1.0) -> bool:
    """True when ``GET url/health`` answers 200 within ``timeout`` seconds."""
    parts = urlsplit(url)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), timeout)
        return line.split(b" ")[1:2] == [b"200"]
    except (OSError, asyncio.TimeoutError, IndexError):
        return False
    finally:
        writer.close()


def _error(resp: Responder, status: int, message: str, rid: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "BadGatewayError", "param": None,
                                 "code": status}}).encode()
    resp.send(status, body, [("content-type", "application/json"), ("x-request-id", rid)])


class PdFakeServer(FakeServer):
    """Decode role: check the named prefill first; other roles: as ``FakeServer``."""

    async def handle(self, req: Request, resp: Responder) -> None:
        if self.config.role == "decode" and req.method == "POST" and req.path in OPENAI_PATHS:
            rid = req.headers.get("x-request-id", "")
            prefill = req.headers.get("x-pd-prefill-url")
            if not prefill:
                _error(resp, 400, "a decode worker needs X-PD-Prefill-Url", rid)
                return
            if not await prefill_reachable(prefill):
                self.recent.append({"request_id": rid, "path": req.path, "status": 502,
                                    "headers": req.headers})
                _error(resp, 502, f"prefill worker {prefill} is unreachable", rid)
                return
        await super().handle(req, resp)


async def _serve(argv: list[str]) -> None:
    config = parse_args(argv)
    server = PdFakeServer(config, on_die=lambda: os._exit(1))
    http = HttpServer(server.handle, config.host, config.port)
    await http.start()
    print(f"pd fake ({config.role}) listening on http://{config.host}:{http.port}", flush=True)
    await http.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(_serve(sys.argv[1:]))
    except KeyboardInterrupt:
        pass
