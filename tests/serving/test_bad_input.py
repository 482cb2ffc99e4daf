"""Every malformed or unsupported request to a real worker gets a 4xx in OpenAI's error format, naming the field.

One mixed worker (embedded stories260K) serves the whole table; afterwards it is healthy, serves, and every page
is free again.
"""

from __future__ import annotations

import json

import httpx
import pytest
from bad_input_cases import CASES, CHAT, MSG, OK, C, assert_openai_error, send, with_
from worker_kit import running_worker


@pytest.fixture(scope="module")
def worker():
    with running_worker() as w:
        yield w


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_an_openai_4xx(worker, case):
    _, path, body, status, param, code = case
    with httpx.Client(base_url=worker.url, timeout=30) as c:
        assert_openai_error(send(c, path, body), status, param, code)


def test_unknown_route_and_wrong_method(worker):
    with httpx.Client(base_url=worker.url, timeout=10) as c:
        err = assert_openai_error(c.post("/v1/nothing", json={}), 404, None, "unknown_url")
        assert "/v1/nothing" in err["message"]
        assert_openai_error(c.get("/v2/models"), 404, None, "unknown_url")
        r = c.get(C)
        assert_openai_error(r, 405, None, "method_not_allowed")
        assert r.headers["allow"] == "POST"
        assert_openai_error(c.delete("/health"), 405, None, "method_not_allowed")


def test_harmless_metadata_and_no_op_defaults_are_accepted(worker):
    """`user`, `store`, `metadata`, `service_tier` and refused fields at their no-op value change nothing."""
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        ref = c.post(C, json=OK).json()["choices"][0]["text"]
        body = with_(OK, user="u1", store=False, metadata={"k": "v"}, service_tier="auto", n=1, best_of=1,
                     echo=False, suffix=None, logit_bias={}, presence_penalty=0, frequency_penalty=0.0)
        r = c.post(C, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        chat = with_(MSG, user="u1", store=True, metadata={"a": "b"}, service_tier="default", tools=[],
                     tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=True)
        r = c.post(CHAT, json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == c.post(CHAT, json=MSG).json()[
            "choices"][0]["message"]["content"]


def test_worker_is_whole_after_the_table(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        assert c.get("/health").json()["status"] == "ok"
        r = c.post(C, json=with_(OK, max_tokens=8))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        load = c.get("/get_load").json()
        assert load["num_free_pages"] == load["num_total_pages"], load
        assert load["num_running_reqs"] == 0 and load["num_queue_reqs"] == 0


def test_error_events_are_json_with_request_id(worker):
    with httpx.Client(base_url=worker.url, timeout=10) as c:
        r = c.post(C, json=with_(OK, temperature=-1), headers={"X-Request-Id": "bad-1"})
        assert r.headers["x-request-id"] == "bad-1"
        assert json.loads(r.text)["error"]["param"] == "temperature"
