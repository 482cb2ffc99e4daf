"""The server-side breakdown: scraping pd: metrics before/after, discovery through a router's
GET /workers, and known phase times from the fake worker's emulated queue/prefill/transfer."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from bench_testkit import bench

from pd_cluster.bench import prom
from pd_cluster.bench.config import ServerMetricsConfig
from pd_cluster.bench.httpserver import HttpServer
from pd_cluster.bench.server_metrics import discover

pytestmark = pytest.mark.timeout(120)


class StubRouter:
    """A loopback server with a router's admin answers (GET /workers, /metrics), in a thread."""

    def __init__(self, workers: list[dict] | dict | None, metrics: str | None, admin_key: str | None = None) -> None:
        self.workers, self.metrics, self.admin_key = workers, metrics, admin_key
        self.loop = asyncio.new_event_loop()
        self.server = HttpServer(self._handle)
        self.loop.run_until_complete(self.server.start())
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _handle(self, req, resp):
        if req.path == "/workers" and self.admin_key and req.headers.get("authorization") != f"Bearer {self.admin_key}":
            resp.send(401, b'{"error": {"message": "invalid or missing admin API key"}}', [])
        elif req.path == "/workers" and self.workers is not None:
            resp.send(200, json.dumps(self.workers).encode(), [("content-type", "application/json")])
        elif req.path == "/metrics" and self.metrics is not None:
            resp.send(200, self.metrics.encode(), [("content-type", "text/plain")])
        elif req.path == "/v1/models":
            resp.send(200, b'{"data": [{"id": "stories260K"}]}', [("content-type", "application/json")])
        else:
            resp.send(404, b"{}", [])

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.slow
def test_breakdown_reports_the_fakes_phase_times(fake_factory):
    fake = fake_factory("--role", "decode", "--ttft-ms", "50", "--queue-ms", "5", "--transfer-ms", "15",
                        "--itl-ms", "5", "--num-tokens", "6", "--kv-bytes-per-token", "2048")
    res = bench(fake.url, "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "6",
                "--num-prompts", "40", "--request-rate", "50", "--warmup-requests", "3",
                "--worker-metrics-url", fake.url, "--metrics-poll-interval", "0.05")
    b = res["server_breakdown"]
    phases = {(p["phase"], p["role"]): p for p in b["phases"]}
    expect = {"queue": 5.0, "prefill": 30.0, "transfer": 15.0, "decode": 25.0}
    for phase, ms in expect.items():
        p = phases[(phase, "decode")]
        assert p["count"] == 40  # the warm-up is outside the before/after scrapes
        assert p["mean_ms"] == pytest.approx(ms, abs=2.5)
        assert p["p99_ms"] >= p["p50_ms"] > 0
    kv = b["kv_transfer"][0]
    total_in = res["summary"]["total_input_tokens"]
    assert total_in == 40 * 32 and kv["transfers"] == 40
    assert kv["bytes"] == total_in * 2048  # the fake counts words; synthetic prompts are one token per word
    assert kv["gb_per_s_while_transferring"] == pytest.approx(32 * 2048 / 0.015 / 1e9, rel=0.15)
    assert 0 < b["peak_token_usage"][fake.url] < 0.1
    assert b["counters"]["decode"]["pd:generation_tokens_total"] == 40 * 6


@pytest.mark.slow
def test_discovery_through_the_routers_workers_list(fake_factory):
    pre = fake_factory("--role", "prefill")
    dec = fake_factory("--role", "decode")
    workers = {"workers": [{"url": pre.url, "role": "prefill"}, {"url": dec.url + "/", "role": "decode"}]}
    router = StubRouter(workers, "# TYPE pd_router_requests_total counter\npd_router_requests_total 7\n",
                        admin_key="s3cret")
    try:
        locked = discover(router.url, ServerMetricsConfig())
        assert [ep.role for ep in locked.endpoints] == ["router"]
        assert "pass --admin-api-key" in " ".join(locked.notes)
        scraper = discover(router.url, ServerMetricsConfig(api_key="s3cret"))
        assert scraper is not None
        roles = {ep.url: ep.role for ep in scraper.endpoints}
        assert roles == {router.url: "router", pre.url: "prefill", dec.url: "decode"}
        before = scraper.snapshot()
        for _ in range(3):
            httpx.post(dec.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 4}, timeout=10)
        after = scraper.snapshot()
        out = scraper.breakdown(before, after, 1.0)
        decode_rows = [p for p in out["phases"] if p["role"] == "decode" and p["phase"] == "decode"]
        assert decode_rows and decode_rows[0]["count"] == 3
        assert not [p for p in out["phases"] if p["role"] == "prefill"]
        assert "found 2 workers" in " ".join(out["notes"])
        plain_list = StubRouter(workers["workers"], None)  # the contract's bare-list form works too
        try:
            assert len(discover(plain_list.url, ServerMetricsConfig()).endpoints) == 2
        finally:
            plain_list.close()
    finally:
        router.close()


def test_plain_openai_server_has_no_breakdown():
    router = StubRouter(None, None)
    try:
        assert discover(router.url, ServerMetricsConfig(timeout_s=2)) is None
    finally:
        router.close()


def test_histogram_quantile_matches_prometheus():
    text = ("# TYPE x histogram\nx_bucket{le=\"0.1\"} 10\nx_bucket{le=\"0.2\"} 30\n"
            "x_bucket{le=\"0.4\"} 40\nx_bucket{le=\"+Inf\"} 40\nx_sum 6.0\nx_count 40\n")
    h = prom.histogram_delta({}, prom.parse(text), "x")
    assert h.mean == pytest.approx(0.15)
    assert h.quantile(0.5) == pytest.approx(0.15)    # rank 20: half-way through (0.1, 0.2]
    assert h.quantile(0.99) == pytest.approx(0.392)  # rank 39.6: 96% through (0.2, 0.4]
    assert h.quantile(0.25) == pytest.approx(0.1)
