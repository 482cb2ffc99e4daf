"""Retries before the first token, timeouts, disconnects and mid-stream failures."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FAST = ["--ttft-ms", "10", "--itl-ms", "2", "--num-tokens", "64"]
ROUTER = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin",
          "--retry-initial-backoff-ms", "5", "--health-check-interval-secs", "0.5",
          "--health-failure-threshold", "2", "--health-success-threshold", "1"]


def complete(router: RouterProc, rid: str, timeout: float = 30, **extra) -> httpx.Response:
    body = {"model": "stories260K", "prompt": "a b c", "max_tokens": 4, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=timeout,
                      headers={"x-request-id": rid})


def test_overloaded_decode_503_is_retried_on_the_other_decode_and_left_alone():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", FAST + ["--fail-every", "1", "--fail-status", "503"]) as bad, \
            FakeWorker("decode", FAST) as good, \
            RouterProc(["--prefill", p.url, "--decode", bad.url, good.url, *ROUTER]) as router:
        started = time.monotonic()
        retries = []
        for i in range(6):
            r = complete(router, f"req-503-{i}", stream=i == 0)  # the retried first one streams
            assert r.status_code == 200, r.text
            retries.append(r.headers["x-pd-retries"])
            if i == 0:
                events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
                assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == " Once upon a time"
            else:
                assert r.json()["choices"][0]["text"] == " Once upon a time"
        assert retries == ["1"] + ["0"] * 5  # the retry shows in the answer's headers, streamed or not
        assert time.monotonic() - started < 0.9  # all within the refuser's Retry-After (1 s, the default)
        m = router.metrics()
        # The first request went to `bad`, was refused and retried on `good`; `bad` then stayed busy, so
        # round_robin's next turns went to `good` instead of being refused again.
        assert sum(e["status"] == 503 for e in bad.recent()) == len(bad.recent()) == 1
        assert metric_value(m, "pd_router_retries_total", reason="status_503") == 1
        assert sorted(e["request_id"] for e in good.recent()) == [f"req-503-{i}" for i in range(6)]
        # Overload is not a fault: the busy worker's breaker stays closed.
        assert metric_value(m, "pd_router_circuit_state", worker=bad.url) == 0


def test_dead_prefill_502_is_retried_with_another_prefill_and_leaves_rotation():
    with FakeWorker("prefill") as p0, FakeWorker("prefill") as p1, \
            FakeWorker("decode", FAST) as d, \
            RouterProc(["--prefill", p0.url, p1.url, "--decode", d.url, *ROUTER]) as router:
        p0.kill()
        started = time.monotonic()
        headers = {}
        for i in range(10):
            r = complete(router, f"req-502-{i}")
            assert r.status_code == 200, r.text
            headers[f"req-502-{i}"] = r.headers["x-pd-retries"]
        assert time.monotonic() - started < 20
        retried = [e["request_id"] for e in d.recent() if e["status"] == 502]
        assert retried, "the decode worker never saw the dead prefill"
        assert headers == {rid: "1" if rid in retried else "0" for rid in headers}
        m = router.metrics()
        assert metric_value(m, "pd_router_retries_total", reason="status_502") == len(retried)
        assert metric_value(m, "pd_router_retries_total", reason="status_502",
                            code="prefill_unreachable") == len(retried)  # the decode's error code
        # Structured logs: every retry line is JSON and names its request.
        lines = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
        failed = [entry for entry in lines if entry["msg"] == "attempt failed"]
        assert {entry["request_id"] for entry in failed} == set(retried)
        assert all(entry["prefill"] == p0.url and entry["reason"] == "status_502"
                   for entry in failed)
        wait_http(router.url + "/workers", 10, ok=lambda r: not next(
            w for w in r.json()["workers"] if w["url"] == p0.url)["healthy"])
        # Out of rotation: the next requests need no retry.
        before = metric_value(router.metrics(), "pd_router_retries_total")
        for i in range(4):
            assert complete(router, f"req-after-{i}").status_code == 200
        assert metric_value(router.metrics(), "pd_router_retries_total") == before


def test_dead_decode_connection_error_is_retried_and_all_dead_fails_fast():
    with FakeWorker("prefill") as p, FakeWorker("decode", FAST) as d0, \
            FakeWorker("decode", FAST) as d1, \
            RouterProc(["--prefill", p.url, "--decode", d0.url, d1.url, *ROUTER]) as router:
        d0.kill()
        for i in range(4):
            assert complete(router, f"req-dd-{i}").status_code == 200
        assert metric_value(router.metrics(), "pd_router_retries_total",
                            reason="decode_unreachable") >= 1
        d1.kill()
        started = time.monotonic()
        r = complete(router, "req-none")
        assert r.status_code in (502, 503) and "error" in r.json()
        assert time.monotonic() - started < 5


def test_disable_retries_relays_the_worker_status():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", FAST + ["--fail-every", "1", "--fail-status", "503"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url, "--disable-retries"]) as router:
        r = complete(router, "req-noretry")
        assert r.status_code == 503
        err = r.json()["error"]  # the worker's own body, relayed
        assert (err["type"], err["code"]) == ("server_error", "injected_failure"), err
        assert r.headers["x-request-id"] == "req-noretry"


def test_request_timeout_answers_504_in_time():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "5000", "--itl-ms", "1"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url,
                        "--request-timeout-secs", "0.5"]) as router:
        started = time.monotonic()
        r = complete(router, "req-slow")
        took = time.monotonic() - started
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert 0.4 < took < 2.0
        # The router closed its upstream connection: the worker dropped the request.
        wait_http(d.url + "/get_load", 5, ok=lambda r: r.json()["num_running_reqs"] == 0)


def test_client_disconnect_aborts_the_request_at_the_worker():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "10", "--itl-ms", "100", "--num-tokens", "100"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url]) as router:
        with httpx.stream("POST", router.url + "/v1/completions", timeout=30, json={
                "model": "stories260K", "prompt": "x", "max_tokens": 100, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            load = httpx.get(d.url + "/get_load").json()
            assert load["num_running_reqs"] == 1 and load["num_free_pages"] < load["num_total_pages"]
        # 100 tokens take 10 s; the worker must see the abort long before.
        wait_http(d.url + "/get_load", 3, ok=lambda r: r.json()["num_running_reqs"] == 0)
        load = httpx.get(d.url + "/get_load").json()
        assert load["num_free_pages"] == load["num_total_pages"]
        wait_http(router.url + "/metrics", 3, ok=lambda r: metric_value(
            r.text, "pd_router_requests_total", status="499") == 1)


def test_worker_dying_mid_stream_gives_an_error_event_not_a_hang():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "10", "--itl-ms", "5", "--num-tokens", "40",
                                  "--die-after", "1"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url]) as router:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=20)
        got = []
        started = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for chunk in c.completions.create(model="stories260K", prompt="x", max_tokens=40,
                                              stream=True):
                got.append(chunk.choices[0].text)
        assert time.monotonic() - started < 10
        assert "mid-stream" in str(info.value)
        assert 0 < len(got) < 40
        assert metric_value(router.metrics(), "pd_router_upstream_failures_total",
                            reason="stream_broken") == 1
