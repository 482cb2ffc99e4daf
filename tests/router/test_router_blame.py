"""Fail fast, blame right: a 502/504 counts only against the peer that failed.

A decode worker that was frozen answers ``504 kv_transfer_timeout`` for the
requests it held once it runs again; that must not open the healthy prefill's
circuit breaker (it did: every request then got 503 until the breaker timed
out). Breaker transitions are logged.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAST = ["--ttft-ms", "5", "--itl-ms", "1", "--num-tokens", "4"]
ROUTER = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin",
          "--retry-initial-backoff-ms", "1", "--cb-failure-threshold", "2",
          "--cb-timeout-duration-secs", "60", "--health-check-interval-secs", "30"]


def complete(router: RouterProc, rid: str) -> httpx.Response:
    body = {"model": "stories260K", "prompt": "a b c", "max_tokens": 4}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=30,
                      headers={"x-request-id": rid})


def breaker_lines(router: RouterProc) -> list[dict]:
    lines = [json.loads(x) for x in router.log().splitlines() if x.startswith("{")]
    return [x for x in lines if x["msg"].startswith("circuit breaker")]


def test_ambiguous_transfer_timeout_from_decode_does_not_open_the_prefill_breaker():
    stalled = ["--answer-status", "504", "--answer-code", "kv_transfer_timeout"]
    with FakeWorker("prefill") as p, FakeWorker("decode", FAST + stalled) as bad, \
            FakeWorker("decode", FAST) as good, \
            RouterProc(["--prefill", p.url, "--decode", bad.url, good.url, *ROUTER]) as router:
        for i in range(8):
            r = complete(router, f"req-stall-{i}")
            assert r.status_code == 200, r.text
        m = router.metrics()
        assert metric_value(m, "pd_router_circuit_state", worker=p.url) == 0
        assert metric_value(m, "pd_router_upstream_failures_total", role="prefill") == 0
        assert metric_value(m, "pd_router_upstream_failures_total", role="none",
                            reason="status_504") >= 1
        assert not breaker_lines(router)


def test_failed_peer_header_blames_the_decode_and_the_transition_is_logged():
    broken = ["--answer-status", "502", "--answer-code", "kv_transfer_nixl_error",
              "--answer-failed-peer", "decode"]
    with FakeWorker("prefill") as p, FakeWorker("decode", FAST + broken) as bad, \
            FakeWorker("decode", FAST) as good, \
            RouterProc(["--prefill", p.url, "--decode", bad.url, good.url, *ROUTER]) as router:
        for i in range(8):
            assert complete(router, f"req-bad-{i}").status_code == 200
        m = router.metrics()
        assert metric_value(m, "pd_router_circuit_state", worker=p.url) == 0
        assert metric_value(m, "pd_router_circuit_state", worker=bad.url) == 1  # open
        assert metric_value(m, "pd_router_upstream_failures_total", role="decode",
                            reason="status_502") == 2
        opened = [x for x in breaker_lines(router) if x["to_state"] == "open"]
        assert [(x["worker"], x["role"], x["level"]) for x in opened] == \
            [(bad.url, "decode", "warning")]


def test_prefill_failure_code_blames_the_prefill():
    gone = ["--answer-status", "502", "--answer-code", "prefill_unreachable"]
    with FakeWorker("prefill") as p0, FakeWorker("prefill") as p1, \
            FakeWorker("decode", FAST + gone) as d, \
            RouterProc(["--prefill", p0.url, p1.url, "--decode", d.url, *ROUTER,
                        "--retry-max-retries", "2"]) as router:
        for i in range(2):
            assert complete(router, f"req-pf-{i}").status_code == 502
        m = router.metrics()
        assert metric_value(m, "pd_router_upstream_failures_total", role="prefill") == 4
        assert metric_value(m, "pd_router_circuit_state", worker=d.url) == 0
        assert metric_value(m, "pd_router_circuit_state", role="prefill") == 2  # both open


def test_stream_from_a_worker_silent_past_the_first_byte_timeout_is_retried_elsewhere():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "20000", "--itl-ms", "1"]) as slow, \
            FakeWorker("decode", FAST) as fast, \
            RouterProc(["--prefill", p.url, "--decode", slow.url, fast.url, *ROUTER,
                        "--upstream-first-byte-timeout-secs", "0.5"]) as router:
        for i in range(2):  # round robin: one of them goes to the silent worker first
            started = time.monotonic()
            body = {"model": "stories260K", "prompt": "a", "max_tokens": 4, "stream": True}
            with httpx.stream("POST", router.url + "/v1/completions", json=body,
                              timeout=30) as r:
                assert r.status_code == 200
                assert "data: [DONE]" in list(r.iter_lines())
            assert time.monotonic() - started < 5
        m = router.metrics()
        assert metric_value(m, "pd_router_retries_total", reason="idle_timeout") == 1
        assert len(slow.recent()) == 1 and len(fast.recent()) == 2
        # silent before its first byte: a stuck prefill looks the same, so the decode is not blamed
        assert metric_value(m, "pd_router_upstream_failures_total", role="none", reason="idle_timeout") == 1
        assert metric_value(m, "pd_router_circuit_state", worker=slow.url) == 0


def test_a_migration_blaming_the_prefill_does_not_open_its_breaker():
    """A decode frozen mid-stream: the stream migrates to a decode that answers ``kv_transfer_peer_died`` (what
    a real decode answered when the frozen one had broken the prefill's side of a transfer). With one prefill
    worker, opening its breaker would refuse every new request; the router probes it instead."""
    died = ["--answer-status", "502", "--answer-code", "kv_transfer_peer_died"]
    token = ["--token-model", "--ttft-ms", "20", "--itl-ms", "40"]
    with FakeWorker("prefill") as p, FakeWorker("decode", token) as d0, FakeWorker("decode", died) as d1, \
            RouterProc(["--prefill", p.url, "--decode", d0.url, *ROUTER, "--cb-failure-threshold", "1",
                        "--upstream-idle-timeout-secs", "1"]) as router:
        body = {"model": "stories260K", "prompt": "a b c", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            # d1 joins only now, so that no first attempt reaches it (that would be a prefill failure outside
            # a migration); then d0 freezes and the stream migrates to d1
            assert httpx.post(router.url + "/workers", json={"url": d1.url, "role": "decode"},
                              timeout=5).status_code < 300
            os.kill(d0.proc.pid, signal.SIGSTOP)
            try:
                rest = list(lines)
            finally:
                os.kill(d0.proc.pid, signal.SIGCONT)
        assert any('"error"' in line for line in rest) or "data: [DONE]" in rest
        assert any(req["status"] == 502 for req in d1.recent())  # the migration reached d1, which blamed p
        m = router.metrics()
        assert metric_value(m, "pd_router_circuit_state", worker=p.url) == 0
        assert metric_value(m, "pd_router_upstream_failures_total", role="prefill") == 0
        assert not [x for x in breaker_lines(router) if x["worker"] == p.url]
