"""The router's OpenAI surface, end to end: real router process, real openai client,
fake PD workers (2 prefill, 2 decode) on loopback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DECODE_ARGS = ["--ttft-ms", "20", "--itl-ms", "5", "--num-tokens", "64"]


@pytest.fixture(scope="module")
def cluster():
    workers = [FakeWorker("prefill"), FakeWorker("prefill"),
               FakeWorker("decode", DECODE_ARGS), FakeWorker("decode", DECODE_ARGS)]
    try:
        for w in workers:
            w.start()
        prefill, decode = workers[:2], workers[2:]
        args = ["--prefill", *(w.url for w in prefill), "--decode", *(w.url for w in decode),
                "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                "--enable-log-requests"]
        with RouterProc(args) as router:
            yield router, prefill, decode
    finally:
        for w in workers:
            w.stop()


def client(router: RouterProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def seen_by(decode: list[FakeWorker], request_id: str) -> dict:
    for w in decode:
        for entry in w.recent():
            if entry["request_id"] == request_id:
                return {"worker": w.url, **entry}
    raise AssertionError(f"no decode worker saw {request_id}")


def test_completion_exact_text_usage_and_request_id(cluster):
    router, prefill, decode = cluster
    out = client(router).with_options(default_headers={"X-Request-Id": "req-exact-1"}) \
        .completions.with_raw_response.create(model="stories260K", prompt="one two three",
                                              max_tokens=5)
    assert out.headers["x-request-id"] == "req-exact-1"
    body = out.parse()
    assert body.choices[0].text == " Once upon a time there"
    assert body.choices[0].finish_reason == "length"
    assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (3, 5)
    entry = seen_by(decode, "req-exact-1")
    assert entry["headers"]["x-pd-prefill-url"] in {p.url for p in prefill}
    assert "req-exact-1" in router.log()


def test_streamed_chat_with_usage(cluster):
    router, _, _ = cluster
    stream = client(router).chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=6, stream=True, stream_options={"include_usage": True})
    text, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(text) == " Once upon a time there was"
    assert reasons == ["length"]
    assert usage.completion_tokens == 6


def test_raw_sse_ends_with_done_and_body_is_forwarded_unchanged(cluster):
    router, _, decode = cluster
    body = {"model": "stories260K", "prompt": "a b", "max_tokens": 3, "stream": True,
            "temperature": 0.7, "top_p": 0.9, "seed": 11, "stop": ["zzz"], "logprobs": 2,
            "return_token_ids": True}  # the ids the router's migration needs are asked for by the client
    raw = json.dumps(body, separators=(",", ":")).encode()
    with httpx.stream("POST", router.url + "/v1/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json",
                               "x-request-id": "req-raw-sse",
                               "x-pd-prefill-url": "http://198.51.100.7:1"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert sum(1 for e in events if '"text":" ' in e) == 3
    entry = seen_by(decode, "req-raw-sse")
    # The client's X-PD-Prefill-Url is never trusted: the router names its own prefill.
    assert entry["headers"]["x-pd-prefill-url"].startswith("http://127.0.0.1:")
    assert entry["headers"]["content-length"] == str(len(raw))


def test_round_robin_spreads_over_both_pairs(cluster):
    router, prefill, decode = cluster
    ids = [f"req-rr-{i}" for i in range(8)]
    for rid in ids:
        r = httpx.post(router.url + "/v1/completions", headers={"x-request-id": rid}, timeout=30,
                       json={"model": "stories260K", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
    entries = [seen_by(decode, rid) for rid in ids]
    assert sorted(sum(e["worker"] == d.url for e in entries) for d in decode) == [4, 4]
    prefills = [e["headers"]["x-pd-prefill-url"] for e in entries]
    assert sorted(prefills.count(p.url) for p in prefill) == [4, 4]


def test_models_endpoint(cluster):
    router, _, _ = cluster
    assert [m.id for m in client(router).models.list()] == ["stories260K"]


def test_openai_errors_have_the_right_status(cluster):
    router, _, _ = cluster
    c = client(router)
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert nf.value.body["code"] == "model_not_found"
    assert nf.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):  # relayed from the worker, not retried
        c.completions.create(model="stories260K", prompt="x", max_tokens=0)
    r = httpx.post(router.url + "/v1/completions", content=b'{"prompt": ', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "invalid_request_error", "param": None,
        "code": "invalid_json"}
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "stories260K"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_metrics_count_requests_latency_and_choices(cluster):
    router, _, decode = cluster
    before = router.metrics()
    for _ in range(3):
        httpx.post(router.url + "/v1/completions", timeout=30,
                   json={"model": "stories260K", "prompt": "x", "max_tokens": 2, "stream": True})
    after = router.metrics()
    key = dict(endpoint="completions", status="200")
    assert metric_value(after, "pd_router_requests_total", **key) - \
        metric_value(before, "pd_router_requests_total", **key) == 3
    assert metric_value(after, "pd_router_time_to_first_token_seconds_count") - \
        metric_value(before, "pd_router_time_to_first_token_seconds_count") == 3
    assert metric_value(after, "pd_router_worker_requests_total", role="decode") - \
        metric_value(before, "pd_router_worker_requests_total", role="decode") == 3
    for d in decode:
        assert metric_value(after, "pd_router_worker_healthy", worker=d.url) == 1
        assert metric_value(after, "pd_router_circuit_state", worker=d.url) == 0
    assert metric_value(after, "pd_router_queue_depth") == 0.0 and "pd_router_queue_depth{model_name=" in after


def test_health_readiness_and_worker_list(cluster):
    router, prefill, decode = cluster
    assert httpx.get(router.url + "/health").json() == {"status": "ok"}
    assert httpx.get(router.url + "/readiness").status_code == 200
    listed = httpx.get(router.url + "/workers").json()["workers"]
    assert {(w["url"], w["role"], w["healthy"]) for w in listed} == \
        {(w.url, w.role, True) for w in prefill + decode}
