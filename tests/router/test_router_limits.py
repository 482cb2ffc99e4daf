"""Admission limits, API keys, body size and the admin API."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BODY = {"model": "stories260K", "prompt": "a b", "max_tokens": 2}


@pytest.fixture(scope="module")
def pd():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "800", "--itl-ms", "1", "--num-tokens", "2"]) as d:
        yield p, d


def test_overload_past_max_concurrent_requests_gets_429_and_no_crash(pd):
    p, d = pd
    with RouterProc(["--prefill", p.url, "--decode", d.url, "--max-concurrent-requests", "2",
                     "--queue-size", "1", "--queue-timeout-secs", "10"]) as router:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(*(
                    c.post(router.url + "/v1/completions", json=BODY) for _ in range(10)))

        results = asyncio.run(burst())
        codes = sorted(r.status_code for r in results)
        assert codes == [200] * 3 + [429] * 7  # 2 running + 1 queued
        rejected = [r for r in results if r.status_code == 429]
        assert all(r.headers["retry-after"] == "1" for r in rejected)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
        assert httpx.get(router.url + "/health").status_code == 200
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        m = router.metrics()
        assert metric_value(m, "pd_router_rejected_requests_total", reason="queue_full") == 7
        assert metric_value(m, "pd_router_requests_total", status="429") == 7


def test_queue_timeout_is_429_too(pd):
    p, d = pd
    with RouterProc(["--prefill", p.url, "--decode", d.url, "--max-concurrent-requests", "1",
                     "--queue-size", "5", "--queue-timeout-secs", "0.2"]) as router:
        async def two() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(*(
                    c.post(router.url + "/v1/completions", json=BODY) for _ in range(2)))

        assert sorted(r.status_code for r in asyncio.run(two())) == [200, 429]


def test_api_key_and_admin_key(pd):
    p, d = pd
    with RouterProc(["--prefill", p.url, "--decode", d.url, "--api-key", "sk-right",
                     "--admin-api-key", "adm-right"]) as router:
        url = router.url + "/v1/completions"
        assert httpx.post(url, json=BODY).status_code == 401
        wrong = httpx.post(url, json=BODY, headers={"authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0) \
                .models.list()
        ok = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-right", max_retries=0)
        assert ok.completions.create(**BODY).choices[0].text == " Once upon"
        assert [m.id for m in ok.models.list()] == ["stories260K"]
        assert httpx.get(router.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(router.url + "/workers",
                         headers={"authorization": "Bearer sk-right"}).status_code == 401
        listed = httpx.get(router.url + "/workers", headers={"authorization": "Bearer adm-right"})
        assert listed.status_code == 200 and len(listed.json()["workers"]) == 2


def test_admin_api_is_closed_when_only_an_api_key_is_set(pd):
    p, d = pd
    with RouterProc(["--prefill", p.url, "--decode", d.url, "--api-key", "sk"]) as router:
        for method in ("GET", "POST", "DELETE"):
            r = httpx.request(method, router.url + "/workers", headers={
                "authorization": "Bearer sk"}, json={"url": "http://127.0.0.1:1", "role": "decode"})
            assert r.status_code == 403


def test_body_over_the_limit_is_413(pd):
    p, d = pd
    with RouterProc(["--prefill", p.url, "--decode", d.url, "--max-payload-size", "1000"]) as router:
        big = {**BODY, "prompt": "x " * 1000}
        r = httpx.post(router.url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(10):
                yield b" " * 200
            yield b'{"prompt": "x"}'

        r = httpx.post(router.url + "/v1/completions", content=chunks())
        assert r.status_code == 413
        assert httpx.post(router.url + "/v1/completions", json=BODY, timeout=30).status_code == 200


def test_admin_api_adds_lists_and_removes_workers(pd):
    p, d = pd
    with FakeWorker("decode", ["--ttft-ms", "5", "--itl-ms", "1"]) as d2, \
            RouterProc(["--prefill", p.url, "--decode", d.url]) as router:
        admin = router.url + "/workers"
        r = httpx.post(admin, json={"url": d2.url, "role": "decode"}, timeout=10)
        assert r.status_code == 201 and r.json()["healthy"] is True
        assert httpx.post(admin, json={"url": d2.url, "role": "decode"}).status_code == 200
        assert httpx.post(admin, json={"url": d2.url, "role": "prefill"}).status_code == 400
        assert httpx.post(admin, json={"url": "http://x:1/evil/path", "role": "decode"}) \
            .status_code == 400
        missing = httpx.post(admin, json={"url": d2.url})  # validation errors are 400s too
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "role"
        listed = {w["url"]: w for w in httpx.get(admin).json()["workers"]}
        assert listed[d2.url]["role"] == "decode" and listed[d2.url]["source"] == "admin"
        assert httpx.delete(admin, params={"url": d2.url}).json() == {"removed": d2.url}
        assert httpx.request("DELETE", admin, json={"url": d2.url}).status_code == 404
        assert d2.url not in {w["url"] for w in httpx.get(admin).json()["workers"]}


def test_served_model_name_and_readiness(pd):
    p, d = pd
    with RouterProc(["--prefill", p.url, "--decode", d.url, "--served-model-name", "stories260K",
                     "tiny"]) as router:
        models = httpx.get(router.url + "/v1/models").json()["data"]
        assert sorted(m["id"] for m in models) == ["stories260K", "tiny"]
        r = httpx.post(router.url + "/v1/completions", json={**BODY, "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # Decode workers but no prefill worker: alive, not ready, and requests get 503.
    with RouterProc(["--decode", d.url], ready="/health") as router:
        assert httpx.get(router.url + "/readiness").status_code == 503
        r = httpx.post(router.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"


def test_mixed_workers_are_routed_without_a_prefill():
    with FakeWorker("mixed", ["--ttft-ms", "5", "--itl-ms", "1"]) as m0, \
            FakeWorker("mixed", ["--ttft-ms", "5", "--itl-ms", "1"]) as m1, \
            RouterProc(["--worker", m0.url, m1.url, "--policy", "round_robin"]) as router:
        for i in range(4):
            r = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                           headers={"x-request-id": f"mixed-{i}"},
                           json={"model": "stories260K", "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == " Once upon"
        entries = [e for w in (m0, m1) for e in w.recent() if e["request_id"].startswith("mixed-")]
        assert len(entries) == 4 and len(m0.recent()) == 2
        assert all("x-pd-prefill-url" not in e["headers"] for e in entries)
