"""OpenAI's error ``type`` for an HTTP status: one answer for the router, the workers and the bench fakes.

Every error body in pd-cluster has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. The
``type`` follows the status as OpenAI's API and its SDK use it: ``authentication_error`` (401),
``permission_error`` (403), ``rate_limit_error`` (429), ``server_error`` (every 5xx), and
``invalid_request_error`` for every other 4xx (400, 404, 405, 409, 413, 415, 422, 431, 499, ...). The
machine-readable reason is the ``code`` (``invalid_value``, ``stale_peer``, ``queue_full``...), chosen by whoever
answers.
"""

from __future__ import annotations

_SPECIFIC = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def openai_error_type(status: int) -> str:
    """The ``type`` of an OpenAI error body answered with HTTP `status`."""
    if status in _SPECIFIC:
        return _SPECIFIC[status]
    return "server_error" if status >= 500 else "invalid_request_error"
