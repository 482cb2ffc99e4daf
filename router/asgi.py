"""Small raw-ASGI helpers for the request path (no framework on the hot path).

The generate endpoints run as plain ASGI on uvicorn (httptools, uvloop): a
minimal FastAPI forwarding route costs about twice the CPU per request of the
same route as raw ASGI, more than the whole router (``docs/perf/router.md``).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pd_cluster.router.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class BodyTooLarge(Exception):
    """The request body passed the limit."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case bytes), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def oversized_headers(scope: Scope, max_bytes: int, max_count: int) -> str | None:
    """Why the request's headers are too large (sum of names and values in bytes, or their count), or ``None``."""
    headers = scope["headers"]
    if len(headers) > max_count:
        return f"{len(headers)} request headers; at most {max_count} are accepted"
    size = sum(len(k) + len(v) for k, v in headers)
    if size > max_bytes:
        return f"request headers of {size} bytes; at most {max_bytes} are accepted"
    return None


def valid_request_id(value: bytes | None) -> str | None:
    """A client-given request id if it is short and plain (else ``None``)."""
    if not value:
        return None
    text = value.decode("latin-1")
    return text if _REQUEST_ID.match(text) else None


def bearer_ok(scope: Scope, key: bytes) -> bool:
    """True when ``Authorization: Bearer <key>`` matches, compared in constant time."""
    got = header(scope, b"authorization") or b""
    if not got[:7].lower() == b"bearer ":
        return False
    return hmac.compare_digest(got[7:].strip(), key)


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; raises :class:`BodyTooLarge` past ``limit`` bytes."""
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge()
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A complete response with ``content-length``."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, status: int, message: str, request_id: str | None = None,
                     param: str | None = None,
                     extra: Iterable[tuple[bytes, bytes]] = (), code: str | None = None) -> None:
    """An OpenAI-format JSON error response (``router.errors``)."""
    headers = list(extra)
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    await send_bytes(send, status, error_body(status, message, param, code), b"application/json",
                     headers)
