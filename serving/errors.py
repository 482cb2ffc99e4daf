"""OpenAI-format error bodies and the mapping from exceptions to HTTP statuses.

Body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's format).
Retriable statuses for the router: 502, 503, 504 (see docs/worker-api.md).
"""

from __future__ import annotations

import json
from typing import Any

from pd_cluster.engine.errors import EngineOverloaded, RequestRejected
from pd_cluster.transfer.errors import LayoutMismatchError, StalePeerError, TransferError, TransferTimeoutError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 502: "server_error",
          503: "server_error", 504: "server_error"}


class HTTPError(Exception):
    """An error that becomes an HTTP answer with an OpenAI body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def to_http_error(exc: BaseException) -> HTTPError:
    """Map an exception from validation or the engine to an `HTTPError`."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestRejected):
        return HTTPError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, EngineOverloaded):
        return HTTPError(503, str(exc), None, "overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):  # SamplingParamError and other parameter errors
        return HTTPError(400, str(exc), getattr(exc, "param", None), "invalid_value")
    return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")


def transfer_http_error(e: BaseException) -> HTTPError:
    """Map a KV-transfer failure to an `HTTPError` (both roles): stale peer or layout mismatch 409,
    timeout 504, any other transfer error 502; anything else as `to_http_error`."""
    if isinstance(e, StalePeerError):
        return HTTPError(409, str(e), None, "stale_peer")
    if isinstance(e, LayoutMismatchError):
        return HTTPError(409, str(e), None, "kv_layout_mismatch")
    if isinstance(e, TransferTimeoutError):
        return HTTPError(504, str(e), None, "kv_transfer_timeout")
    if isinstance(e, TransferError):
        return HTTPError(502, str(e), None, f"kv_transfer_{e.reason}")
    return to_http_error(e)
