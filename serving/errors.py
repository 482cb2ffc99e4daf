"""OpenAI-format error bodies and the mapping from exceptions to HTTP statuses.

Body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's format).
Retriable statuses for the router: 502, 503, 504 (see docs/worker-api.md).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.common.openai_errors import openai_error_type
from pd_cluster.engine.errors import EngineOverloaded, RequestRejected

logger = logging.getLogger("pd.serving")


class EngineDeadError(RuntimeError):
    """The worker's engine loop died: every request in flight fails with it (HTTP 503, code ``engine_dead``),
    and the worker process exits so that its supervisor restarts it."""


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
    """OpenAI's error body; ``type`` follows the status (`pd_cluster.common.openai_errors.openai_error_type`)."""
    return {"error": {"message": message, "type": openai_error_type(status), "param": param, "code": code}}


def error_response(err: HTTPError, request_id: str | None = None) -> JSONResponse:
    """The JSON response of `err` (with ``X-Request-Id`` when given)."""
    headers = dict(err.headers)
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def install_error_handlers(app: Any) -> None:
    """Answer every error of `app` in OpenAI's format: unknown routes (404), wrong methods (405), FastAPI's
    own validation errors (400), `HTTPError` raised by a handler, and any other exception (500)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            err = HTTPError(404, f"Invalid URL ({request.method} {request.url.path})", None, "unknown_url")
        elif exc.status_code == 405:
            err = HTTPError(405, f"Method {request.method} is not allowed for {request.url.path}", None,
                            "method_not_allowed")
        else:
            err = HTTPError(exc.status_code, str(exc.detail), None, None)
        err.headers.update(exc.headers or {})
        return error_response(err)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error_response(HTTPError(400, f"{param}: {first.get('msg')}", param, "invalid_value"))

    async def on_http_error(request: Request, exc: HTTPError) -> Response:
        return error_response(exc)

    async def on_exception(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(to_http_error(exc))

    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPError, on_http_error)
    app.add_exception_handler(Exception, on_exception)


def to_http_error(exc: BaseException) -> HTTPError:
    """Map an exception from validation or the engine to an `HTTPError`."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestRejected):
        return HTTPError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, EngineDeadError):
        return HTTPError(503, str(exc), None, "engine_dead")
    if isinstance(exc, EngineOverloaded):
        return HTTPError(503, str(exc), None, "overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):  # SamplingParamError and other parameter errors
        return HTTPError(400, str(exc), getattr(exc, "param", None), "invalid_value")
    return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")
