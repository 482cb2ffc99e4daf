"""OpenAI-format error bodies: one shape for every 4xx and 5xx the router answers.

Shape: ``{"error": {"message", "type", "param", "code"}}`` as in OpenAI's API; the
``type`` follows the status as for the workers (`pd_cluster.common.openai_errors.openai_error_type`).
``code`` is a short machine-readable string (``invalid_value``,
``model_not_found``, ``queue_full``, ``no_healthy_worker``...); the HTTP
status is the response's status line.
"""

from __future__ import annotations

import json

from pd_cluster.common.openai_errors import openai_error_type

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


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    """JSON bytes of an OpenAI error for ``status`` (``code`` defaults by status)."""
    return json.dumps({"error": {
        "message": message, "type": openai_error_type(status), "param": param,
        "code": code or DEFAULT_CODES.get(status, "error")}}).encode()


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error (mid-stream failures)."""
    return b"data: " + error_body(status, message, code=code) + b"\n\n"
