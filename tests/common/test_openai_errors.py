"""One OpenAI error `type` per HTTP status, the same from the router and from the workers."""

from __future__ import annotations

import json

import pytest

from pd_cluster.common.openai_errors import openai_error_type
from pd_cluster.router import errors as router_errors
from pd_cluster.serving import errors as worker_errors

EXPECTED = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
            413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
            429: "rate_limit_error", 431: "invalid_request_error", 499: "invalid_request_error",
            500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error"}


@pytest.mark.parametrize("status", sorted(EXPECTED))
def test_router_and_workers_give_one_type_per_status(status):
    router = json.loads(router_errors.error_body(status, "m"))["error"]["type"]
    worker = worker_errors.error_body(status, "m")["error"]["type"]
    assert router == worker == openai_error_type(status) == EXPECTED[status]
