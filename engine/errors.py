"""Typed errors for rejected requests, so servers can map them to HTTP statuses.

`RequestRejected` (a `ValueError`) means the request itself is invalid: 400.
`SamplingParamError` (a `ValueError`) means one sampling parameter is: 400 naming it.
`EngineOverloaded` means try again later: 503.
"""

from __future__ import annotations


class SamplingParamError(ValueError):
    """A sampling parameter is invalid (`pd_cluster.engine.sampling`). `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class RequestRejected(ValueError):
    """The request cannot be served as asked (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthExceeded(RequestRejected):
    """Prompt plus requested output exceed ``--context-length``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="max_tokens", code="context_length_exceeded")


class PoolCapacityExceeded(RequestRejected):
    """The request could never fit in the whole KV pool."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="max_tokens", code="kv_pool_capacity_exceeded")


class EngineOverloaded(RuntimeError):
    """The admission queue is full (``--max-queued-requests``); retriable (HTTP 503)."""
