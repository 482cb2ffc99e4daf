"""OpenAI-format error bodies: one shape for every 4xx and 5xx the router answers.

Shape: ``{"error": {"message", "type", "param", "code"}}`` as in OpenAI's API,
with the same ``type`` names the workers use (``serving/errors.py``):
``invalid_request_error`` (400, 404, 405, 413, 431), ``authentication_error`` (401),
``permission_error`` (403), ``rate_limit_error`` (429), ``server_error``
(5xx). ``code`` is a short machine-readable string (``invalid_value``,
``model_not_found``, ``queue_full``, ``no_healthy_worker``...); the HTTP
status is the response's status line.
"""

from __future__ import annotations

import json

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "invalid_request_error",
}

DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    431: "request_header_fields_too_large",
    499: "client_closed_request",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    """JSON bytes of an OpenAI error for ``status`` (``code`` defaults by status)."""
    return json.dumps({"error": {
        "message": message, "type": error_type(status), "param": param,
        "code": code or DEFAULT_CODES.get(status, "error")}}).encode()


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error (mid-stream failures)."""
    return b"data: " + error_body(status, message, code=code) + b"\n\n"
