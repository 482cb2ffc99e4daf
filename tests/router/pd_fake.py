"""A PD-aware fake worker for router tests: ``pd_cluster.bench.fake_server`` plus the prefill check.

A fake decode worker here contacts the prefill worker named in
``X-PD-Prefill-Url`` (``GET /health``) before generating, and answers 502
when it cannot reach it, as a real decode worker does when its prefill died.
Without the header it answers 400. Run as
``python -m tests.router.pd_fake --port N --role decode ...`` (the flags of
``pd_cluster.bench.fake_server``), plus flags of its own:

- ``--token-model``: generate with ``tests.router.token_fake`` (deterministic
  token ids, vLLM's ``return_token_ids``), for migration tests;
- ``--refuse-token-ids``: answer 400 naming ``return_token_ids`` to a request
  that carries it (a worker without the field, strict about unknown fields);
- ``--answer-status S --answer-code C [--answer-failed-peer P]``: answer every
  generate request with status ``S``, error code ``C`` and, if given, the
  ``X-PD-Failed-Peer: P`` header, as a decode worker does when its pair failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from urllib.parse import urlsplit

from pd_cluster.bench.fake_server import FakeServer, parse_args
from pd_cluster.bench.httpserver import HttpServer, Request, Responder
from pd_cluster.common.openai_errors import openai_error_type

from tests.router.token_fake import TokenModel

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


def _error(resp: Responder, status: int, message: str, rid: str, code: str,
           extra: list[tuple[str, str]] = ()) -> None:
    body = json.dumps({"error": {"message": message, "type": openai_error_type(status), "param": None,
                                 "code": code}}).encode()
    resp.send(status, body, [("content-type", "application/json"), ("x-request-id", rid),
                             *extra])


def _own_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--token-model", action="store_true")
    p.add_argument("--answer-status", type=int, default=None)
    p.add_argument("--answer-code", default=None)
    p.add_argument("--answer-failed-peer", default=None)
    p.add_argument("--refuse-token-ids", action="store_true",
                   help="answer 400 naming return_token_ids when a request carries it")
    return p.parse_known_args(argv)


class PdFakeServer(FakeServer):
    """Decode role: check the named prefill first; other roles: as ``FakeServer``."""

    def __init__(self, config, own: argparse.Namespace, on_die=None) -> None:
        super().__init__(config, on_die=on_die)
        self.own = own
        self.tokens = TokenModel(self) if own.token_model else None

    async def handle(self, req: Request, resp: Responder) -> None:
        if self.config.role == "decode" and req.method == "POST" and req.path in OPENAI_PATHS:
            rid = req.headers.get("x-request-id", "")
            prefill = req.headers.get("x-pd-prefill-url")
            if not prefill:
                _error(resp, 400, "a decode worker needs X-PD-Prefill-Url", rid, "missing_prefill")
                return
            if not await prefill_reachable(prefill):
                self.recent.append({"request_id": rid, "path": req.path, "status": 502,
                                    "headers": req.headers})
                _error(resp, 502, f"prefill worker {prefill} is unreachable", rid,
                       "prefill_unreachable")
                return
            own = self.own
            if own.refuse_token_ids and b'"return_token_ids"' in req.body:
                self.recent.append({"request_id": rid, "path": req.path, "status": 400,
                                    "headers": req.headers})
                body = json.dumps({"error": {"message": "unknown field: return_token_ids",
                                             "type": "invalid_request_error",
                                             "param": "return_token_ids",
                                             "code": "invalid_value"}}).encode()
                resp.send(400, body, [("content-type", "application/json"), ("x-request-id", rid)])
                return
            if own.answer_status is not None:
                self.recent.append({"request_id": rid, "path": req.path,
                                    "status": own.answer_status, "headers": req.headers})
                peer = [("x-pd-failed-peer", own.answer_failed_peer)] \
                    if own.answer_failed_peer else []
                _error(resp, own.answer_status, f"injected {own.answer_code}", rid,
                       own.answer_code, peer)
                return
            if self.tokens is not None:
                await self.tokens.handle(req, resp, rid or f"tok-{len(self.recent)}")
                return
        await super().handle(req, resp)


async def _serve(argv: list[str]) -> None:
    own, rest = _own_args(argv)
    config = parse_args(rest)
    server = PdFakeServer(config, own, on_die=lambda: os._exit(1))
    http = HttpServer(server.handle, config.host, config.port)
    await http.start()
    print(f"pd fake ({config.role}) listening on http://{config.host}:{http.port}", flush=True)
    await http.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(_serve(sys.argv[1:]))
    except KeyboardInterrupt:
        pass
