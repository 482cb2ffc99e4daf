"""OpenAI-format error bodies and the router's error statuses.

Shape: ``{"error": {"message", "type", "param", "code"}}`` as in OpenAI's API
and vLLM/SGLang's servers; ``code`` is the HTTP status.
"""

from __future__ import annotations

import json

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """JSON bytes of an OpenAI error for ``status``."""
    return json.dumps({"error": {
        "message": message, "type": ERROR_TYPES.get(status, "APIError"),
        "param": param, "code": status}}).encode()


def sse_error_event(status: int, message: str) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error (mid-stream failures)."""
    return b"data: " + error_body(status, message) + b"\n\n"
