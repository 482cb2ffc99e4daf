"""Unit tests of the router's pure parts: breaker, backoff, limiter, registry, parsing, flags."""

from __future__ import annotations

import asyncio
import random

import pytest

from pd_cluster.router.args import build_parser, config_from_args, parse_config
from pd_cluster.router.circuit import CircuitBreaker, CircuitState
from pd_cluster.router.config import CircuitBreakerConfig, RetryConfig, Role
from pd_cluster.router.limiter import ConcurrencyLimiter, Overloaded
from pd_cluster.router.request import InvalidRequest, parse_request
from pd_cluster.router.retry import backoff_seconds, is_retriable_status
from pd_cluster.router.workers import WorkerRegistry, normalize_url


def breaker(**kw) -> CircuitBreaker:
    return CircuitBreaker(CircuitBreakerConfig(**{
        "failure_threshold": 3, "success_threshold": 2, "timeout_duration_secs": 10.0,
        "window_duration_secs": 5.0, **kw}))


def test_breaker_opens_after_consecutive_failures_and_success_resets_the_count():
    cb = breaker()
    cb.record_failure(0.0)
    cb.record_failure(1.0)
    cb.record_success(1.5)
    cb.record_failure(2.0)
    cb.record_failure(3.0)
    assert cb.state(3.0) is CircuitState.CLOSED
    cb.record_failure(4.0)
    assert cb.state(4.0) is CircuitState.OPEN and not cb.allows(4.0)


def test_breaker_window_forgets_old_failures():
    cb = breaker()
    for t in (0.0, 6.0, 12.0):  # each more than 5 s after the previous
        cb.record_failure(t)
    assert cb.state(12.0) is CircuitState.CLOSED


def test_breaker_half_open_then_closes_or_reopens():
    cb = breaker()
    for t in (0.0, 0.1, 0.2):
        cb.record_failure(t)
    assert cb.state(10.1) is CircuitState.OPEN
    assert cb.state(10.3) is CircuitState.HALF_OPEN and cb.allows(10.3)
    cb.record_failure(10.4)
    assert cb.state(10.5) is CircuitState.OPEN
    assert cb.state(20.5) is CircuitState.HALF_OPEN
    cb.record_success(20.6)
    assert cb.state(20.6) is CircuitState.HALF_OPEN
    cb.record_success(20.7)
    assert cb.state(20.7) is CircuitState.CLOSED
    assert cb.opened_count == 2


def test_disabled_breaker_never_opens():
    cb = breaker(enabled=False)
    for t in range(100):
        cb.record_failure(float(t) / 100)
    assert cb.state(1.0) is CircuitState.CLOSED


def test_backoff_is_exponential_capped_and_jittered():
    cfg = RetryConfig(initial_backoff_ms=100, max_backoff_ms=300, backoff_multiplier=2.0,
                      jitter_factor=0.0)
    rng = random.Random(0)
    assert [backoff_seconds(cfg, n, rng) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]
    jittered = RetryConfig(initial_backoff_ms=100, jitter_factor=0.2)
    values = [backoff_seconds(jittered, 1, rng) for _ in range(500)]
    assert min(values) >= 0.08 and max(values) <= 0.12 and max(values) - min(values) > 0.03
    with pytest.raises(ValueError):
        backoff_seconds(cfg, 0, rng)


def test_retriable_statuses_follow_the_worker_contract():
    assert [s for s in (400, 404, 413, 429, 500, 502, 503, 504) if is_retriable_status(s)] == \
        [502, 503, 504]


@pytest.mark.asyncio
async def test_limiter_queues_in_order_and_rejects_past_the_queue():
    lim = ConcurrencyLimiter(max_running=2, queue_size=2, queue_timeout_secs=5.0)
    await lim.acquire()
    await lim.acquire()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await lim.acquire()
        order.append(name)

    w1 = asyncio.create_task(waiter("first"))
    await asyncio.sleep(0)
    w2 = asyncio.create_task(waiter("second"))
    await asyncio.sleep(0)
    assert lim.queued == 2
    with pytest.raises(Overloaded) as info:
        await lim.acquire()
    assert info.value.reason == "queue_full"
    lim.release()
    await w1
    lim.release()
    await w2
    assert order == ["first", "second"] and lim.running == 2 and lim.queued == 0


@pytest.mark.asyncio
async def test_limiter_queue_timeout_and_cancelled_waiter_leave_no_trace():
    lim = ConcurrencyLimiter(max_running=1, queue_size=4, queue_timeout_secs=0.05)
    await lim.acquire()
    with pytest.raises(Overloaded) as info:
        await lim.acquire()
    assert info.value.reason == "queue_timeout" and lim.queued == 0
    lim.queue_timeout_secs = 5.0
    task = asyncio.create_task(lim.acquire())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lim.queued == 0
    lim.release()
    assert lim.running == 0
    unlimited = ConcurrencyLimiter(max_running=-1, queue_size=0, queue_timeout_secs=1.0)
    for _ in range(1000):
        await unlimited.acquire()
    assert unlimited.running == 1000


def test_normalize_url_accepts_hosts_and_rejects_everything_else():
    assert normalize_url("http://10.0.0.1:8000/") == "http://10.0.0.1:8000"
    assert normalize_url(" https://decode-0.svc:443 ") == "https://decode-0.svc:443"
    for bad in ("ftp://x:1", "http://", "http://u:p@x:1", "http://x:1/v1", "http://x:1?a=1",
                "x:1", "http://x:99999"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_registry_roles_sources_and_usability():
    clock = [0.0]
    reg = WorkerRegistry(CircuitBreakerConfig(failure_threshold=1), clock=lambda: clock[0])
    removed = []
    reg.subscribe(on_removed=lambda w: removed.append(w.url))
    a = reg.add("http://a:1/", Role.PREFILL, "static")
    assert reg.add("http://a:1", Role.PREFILL, "admin") is a
    with pytest.raises(ValueError):
        reg.add("http://a:1", Role.DECODE, "admin")
    b = reg.add("http://b:1", Role.PREFILL, "kubernetes", healthy=True)
    assert reg.usable(Role.PREFILL) == [b]  # a waits for its first health check
    a.healthy = True
    b.breaker.record_failure(0.0)
    assert reg.usable(Role.PREFILL) == [a]
    assert reg.usable(Role.PREFILL, exclude={"http://a:1"}) == []
    assert reg.remove("http://a:1", source="kubernetes") is None
    assert reg.remove("http://a:1") is a and removed == ["http://a:1"]


def test_parse_request_reads_model_stream_and_prompt_text():
    p = parse_request(b'{"model": "m", "prompt": "abc", "stream": true}', chat=False)
    assert (p.model, p.stream, p.text) == ("m", True, "abc")
    p = parse_request(b'{"prompt": [1, 2, 3]}', chat=False)
    assert (p.model, p.stream, p.text) == (None, False, "1,2,3")
    chat = parse_request(b'{"model": "m", "messages": [{"role": "system", "content": "S"},'
                         b'{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}', True)
    assert chat.text == "<system>S<user>hi"
    for body, chat_mode in ((b"{", False), (b"[1]", False), (b'{"model": 3, "prompt": "x"}', False),
                            (b'{"prompt": "x", "stream": "yes"}', False), (b'{"model": "m"}', True),
                            (b'{"messages": "hi"}', True), (b'{"model": "m"}', False)):
        with pytest.raises(InvalidRequest):
            parse_request(body, chat_mode)


def test_flags_build_the_config():
    cfg = parse_config([
        "--prefill", "http://p0:8000", "--prefill", "http://p1:8000", "--decode", "http://d0:8000",
        "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
        "--cache-threshold", "0.5", "--balance-abs-threshold", "8", "--retry-max-retries", "4",
        "--cb-failure-threshold", "5", "--max-concurrent-requests", "64", "--queue-size", "10",
        "--max-payload-size", "1024", "--api-key", "k", "--service-discovery",
        "--prefill-selector", "app=pd", "role=prefill", "--decode-selector", "role=decode",
        "--service-discovery-namespace", "llm"])
    assert cfg.prefill_urls == ("http://p0:8000", "http://p1:8000")
    assert (cfg.policy.prefill, cfg.policy.decode) == ("cache_aware", "power_of_two")
    assert cfg.policy.cache_aware.cache_threshold == 0.5
    assert cfg.policy.cache_aware.balance_abs_threshold == 8
    assert cfg.retry.max_attempts == 4 and cfg.circuit.failure_threshold == 5
    assert (cfg.limits.max_concurrent_requests, cfg.limits.queue_size) == (64, 10)
    assert cfg.security.api_key == "k"
    assert cfg.kubernetes.prefill_selector == "app=pd,role=prefill"
    assert cfg.kubernetes.namespace == "llm"
    assert parse_config(["--disable-retries"]).retry.max_attempts == 1
    assert parse_config(["--policy", "random"]).policy.decode == "random"


def test_bad_flags_are_refused():
    parser = build_parser()
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args(["--service-discovery"]))
    with pytest.raises(ValueError):
        config_from_args(parser.parse_args(["--service-discovery", "--selector", "novalue"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-policy", "fastest"])


@pytest.mark.asyncio
async def test_supervisor_cancels_overdue_requests_and_requests_whose_client_left():
    from pd_cluster.router.supervisor import Supervisor

    sup = Supervisor(tick_secs=0.01)

    async def request(timeout: float, work: float, box: list):
        key, entry = sup.enter(timeout)
        box.append(entry)
        try:
            await asyncio.sleep(work)
            return "done", entry
        except asyncio.CancelledError:
            entry.task.uncancel()
            return ("timed_out" if entry.timed_out else "client_gone"), entry
        finally:
            sup.leave(key)

    ticker = asyncio.create_task(sup.run())
    try:
        short, overdue = await asyncio.gather(request(5.0, 0.01, []), request(0.1, 5.0, []))
        assert short[0] == "done" and overdue[0] == "timed_out"
        box: list = []
        long_task = asyncio.create_task(request(5.0, 5.0, box))
        await asyncio.sleep(0.05)
        Supervisor.client_lost(box[0])  # what the client's connection calls when it closes
        outcome, entry = await asyncio.wait_for(long_task, 2)
        assert outcome == "client_gone" and entry.client_gone
        Supervisor.client_lost(entry)  # after the end: nothing to cancel
        assert len(sup) == 0
    finally:
        ticker.cancel()


def test_kubernetes_discovery_without_the_client_says_which_extra_to_install(monkeypatch):
    import sys

    from pd_cluster.router.main import build_sources

    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if `pip install pd-cluster` without [k8s]
    monkeypatch.delitem(sys.modules, "pd_cluster.router.discovery.kubernetes", raising=False)
    config = parse_config(["--service-discovery", "--service-discovery-namespace", "ns", "--selector", "app=pd"])
    with pytest.raises(SystemExit, match=r"pip install 'pd-cluster\[k8s\]'"):
        build_sources(config)


def test_retry_code_label_is_the_workers_error_code_and_stays_few_valued():
    from pd_cluster.router.relay import AttemptFailure

    assert AttemptFailure("status_502", Role.PREFILL, 502, b"{}", detail="kv_transfer_timeout").code == \
        "kv_transfer_timeout"
    assert AttemptFailure("status_502", None, 502, b"{}").code == ""  # the worker named no code
    assert AttemptFailure("status_503", None, 503, b"{}", detail="Not A Code; 9 words").code == "other"
    assert AttemptFailure("status_502", None, 502, b"{}", detail="x" * 49).code == "other"
    # no status: the detail is what broke (free text), never a label
    assert AttemptFailure("decode_unreachable", Role.DECODE, detail="connection refused").code == ""
