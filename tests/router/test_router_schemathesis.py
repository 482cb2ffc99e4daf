"""A bounded schemathesis run against the router's own ``/openapi.json``.

The decode worker behind it answers every generate request with a 400 in
OpenAI's format (``pd_fake --answer-status 400``), so the run exercises the
router's checks and error bodies without generating tokens for fuzzed
``max_tokens`` (and schema-valid requests are not expected to succeed). The admin API is left out (it would register fuzzed URLs), and so are the pass-through tokenizer routes.
Every response must be no 5xx and conform to the document.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from router_testkit import FakeWorker, RouterProc

from pd_cluster.router.app import RouterApp
from pd_cluster.router.config import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The document the router serves at /openapi.json (checked equal below), without the admin API.
DOCUMENT = RouterApp(RouterConfig()).control.openapi()
# /tokenize, /detokenize and /tokenizer_info pass a worker's answer through (the fake here has none; the workers'
# own schemathesis run, tests/serving/test_openapi_fuzz.py, covers them).
schema = schemathesis.openapi.from_dict(DOCUMENT).exclude(path="/workers").exclude(path="/tokenize") \
    .exclude(path="/detokenize").exclude(path="/tokenizer_info")


@pytest.fixture(scope="module")
def router_url():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--answer-status", "400", "--answer-code", "invalid_value"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url, "--max-payload-size", "65536"]) as r:
        served = httpx.get(r.url + "/openapi.json", timeout=10).json()
        assert served["paths"] == DOCUMENT["paths"]
        yield r.url


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_router_api_conforms_to_its_openapi_document(case, router_url):
    # the worker behind refuses every request on purpose, so schema-valid requests get 400s
    case.call_and_validate(base_url=router_url, timeout=10,
                           excluded_checks=[schemathesis.checks.positive_data_acceptance])
