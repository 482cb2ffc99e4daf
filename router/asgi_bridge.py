"""Runs an ASGI application (the FastAPI control plane) for one `Exchange` of ``router.http_server``.

The control endpoints (health, readiness, metrics, models, the admin API, ``/openapi.json``) are not on the
hot path; they keep FastAPI's validation and documentation. The request body has been read already, so
``receive`` gives it at once and then waits for the client to go; ``send`` writes the response through the
exchange (``content-length`` when the app gives one, else chunked).
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote

from pd_cluster.router.errors import error_body
from pd_cluster.router.exchange import Exchange, status_line

ASGI = {"version": "3.0", "spec_version": "2.3"}


def scope_of(ex: Exchange) -> dict[str, Any]:
    """The ASGI HTTP scope of ``ex``."""
    transport = ex.conn.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    sock = transport.get_extra_info("sockname") if transport is not None else None
    raw = ex.path
    return {"type": "http", "asgi": ASGI, "http_version": "1.1" if ex.http11 else "1.0", "method": ex.method,
            "scheme": "http", "path": unquote(raw.decode("latin-1")), "raw_path": raw, "query_string": ex.query,
            "root_path": "", "headers": ex.headers,
            "client": tuple(peer[:2]) if isinstance(peer, tuple) else None,
            "server": tuple(sock[:2]) if isinstance(sock, tuple) else None, "state": {}}


async def run_asgi(app: Any, ex: Exchange) -> None:
    """Call ``app`` for ``ex``; a 500 in OpenAI's error format if it fails before answering."""
    gone = asyncio.get_running_loop().create_future()
    ex.on_lost = lambda: gone.done() or gone.set_result(None)
    state: dict[str, Any] = {"sent_body": False, "status": 200, "headers": []}

    async def receive() -> dict[str, Any]:
        if not state["sent_body"]:
            state["sent_body"] = True
            return {"type": "http.request", "body": ex.body or b"", "more_body": False}
        await gone
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            state["status"] = message["status"]
            state["headers"] = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            state["length"] = any(k == b"content-length" for k, _ in state["headers"])
        elif kind == "http.response.body":
            body, more = message.get("body", b""), message.get("more_body", False)
            if ex.finished:
                return
            if not ex.started and state.get("length"):
                _whole(ex, state, body) if not more else _start_plain(ex, state, body)
            elif not ex.started:
                if more:
                    ex.start(state["status"], state["headers"])
                    ex.write(body)
                else:
                    _whole(ex, state, body)
            elif ex.chunked:
                ex.end(body) if not more else ex.write(body)
            else:
                ex.conn.write(body)
                if not more:
                    ex._finish()

    try:
        await app(scope_of(ex), receive, send)
    except Exception:
        if not ex.started:
            ex.respond(500, error_body(500, "internal error"))
        raise
    if not ex.finished and ex.started:
        ex.end()


def _whole(ex: Exchange, state: dict[str, Any], body: bytes) -> None:
    headers = [(k, v) for k, v in state["headers"] if k not in (b"content-length", b"content-type")]
    ctype = next((v for k, v in state["headers"] if k == b"content-type"), b"application/octet-stream")
    ex.respond(state["status"], body, ctype, headers)


def _start_plain(ex: Exchange, state: dict[str, Any], body: bytes) -> None:
    """A response with a known length sent in pieces: headers as given, the body as it comes."""
    ex.started = True
    parts = [status_line(state["status"])]
    for k, v in state["headers"]:
        parts += (k, b": ", v, b"\r\n")
    if not ex.keep_alive:
        parts.append(b"connection: close\r\n")
    ex.conn.write(b"".join(parts) + b"\r\n" + body)
