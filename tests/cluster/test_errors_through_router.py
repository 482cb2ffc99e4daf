"""The bad-request table (`tests/support/bad_input_cases.py`), through the router of a real 1P1D cluster and
directly at its decode worker: every case gets the same OpenAI error shape, status, `param` and `code` both ways,
and afterwards both workers serve and hold no page."""

from __future__ import annotations

import httpx
import pytest
from bad_input_cases import CASES, OK, assert_openai_error, send
from cluster_util import wait_all_free

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(pd_1p1d):
    """The shared default 1P1D cluster (`tests/support/shared_clusters.py`): these tests only read from it."""
    return pd_1p1d


def _decode_url(cluster) -> str:
    return next(p.url for p in cluster.procs if p.role == "decode")


def _prefill_url(cluster) -> str:
    return next(p.url for p in cluster.procs if p.role == "prefill")


def test_thirty_or_more_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_openai_error_through_the_router_and_from_the_decode_worker(cluster, case):
    _, path, body, status, param, code = case
    with httpx.Client(base_url=cluster.router_url, timeout=30) as c:
        assert_openai_error(send(c, path, body), status, param, code)
    with httpx.Client(base_url=_decode_url(cluster), timeout=30,
                      headers={"X-PD-Prefill-Url": _prefill_url(cluster)}) as c:
        assert_openai_error(send(c, path, body), status, param, code)


def test_unknown_routes_and_methods_through_the_router(cluster):
    with httpx.Client(base_url=cluster.router_url, timeout=10) as c:
        assert_openai_error(c.post("/v1/nothing", json={}), 404, None)
        assert_openai_error(c.get("/v1/completions"), 405, None)


def test_cluster_is_whole_after_the_table(cluster):
    with httpx.Client(base_url=cluster.router_url, timeout=60) as c:
        r = c.post("/v1/completions", json=dict(OK, max_tokens=8))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    wait_all_free(cluster, timeout=10)


def test_tokenize_and_detokenize_through_the_router(cluster):
    """The router passes vLLM's /tokenize, /detokenize and /tokenizer_info to a worker that holds the tokenizer."""
    with httpx.Client(base_url=cluster.router_url, timeout=30) as c:
        ids = c.post("/tokenize", json={"prompt": "Once upon a time"})
        assert ids.status_code == 200, ids.text
        tokens = ids.json()["tokens"]
        assert ids.json()["count"] == len(tokens) > 0
        text = c.post("/detokenize", json={"tokens": tokens})
        assert text.status_code == 200 and "Once upon a time" in text.json()["prompt"]
        info = c.get("/tokenizer_info")
        assert info.status_code == 200, info.text
        assert (info.json()["bos_token"], info.json()["eos_token"]) == ("<s>", "</s>")
        decode = next(p for p in cluster.procs if p.role == "decode")
        assert info.json() == httpx.get(decode.url + "/tokenizer_info", timeout=10).json()
