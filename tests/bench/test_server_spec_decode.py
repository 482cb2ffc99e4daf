"""pd-bench's server breakdown reads speculative decoding's counters: the mean accepted length (vLLM's "mean
acceptance length", 1 + accepted / drafts) and the acceptance rate, per role, from a worker's real exposition
(vLLM's ``vllm:spec_decode_*`` names first, pd-cluster's ``pd:`` twins otherwise; never both counted)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from pd_cluster.bench import prom
from pd_cluster.bench.report import _breakdown_lines
from pd_cluster.bench.server_metrics import mean_accepted_length, spec_decode
from pd_cluster.serving.metrics import WorkerMetrics


def _scrape(drafts: int, draft_tokens: int, accepted: int) -> prom.Scrape:
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, "decode", "m")
    spec = SimpleNamespace(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                           accepted_per_pos=[accepted])
    m.spec_decode.on_step(SimpleNamespace(stats=SimpleNamespace(spec=spec)))
    return prom.parse(generate_latest(registry).decode())


def test_mean_accepted_length_and_acceptance_rate_over_the_run():
    url, router = "http://d", "http://r"
    before, after = {url: _scrape(10, 40, 15)}, {url: _scrape(30, 120, 55), router: _scrape(99, 99, 99)}
    rows = spec_decode(before, after, {url: "decode", router: "router"})
    assert rows == [{"role": "decode", "drafts": 20, "draft_tokens": 80, "accepted_tokens": 40,
                     "acceptance_rate": 0.5, "mean_accepted_length": 3.0}]
    b = {"spec_decode": rows}
    assert mean_accepted_length(b) == 3.0
    lines = _breakdown_lines(dict(b, phases=[], kv_transfer=[], peak_token_usage={}, notes=[]))
    assert any("Spec decode mean accepted length [decode]:" in line and "3.00" in line for line in lines), lines


def test_pd_names_alone_are_read_and_a_run_without_drafts_reports_nothing():
    url = "http://d"
    only_pd = {k: v for k, v in _scrape(4, 8, 2).items() if k[0].startswith("pd:")}
    assert spec_decode({}, {url: only_pd}, {url: "decode"})[0]["mean_accepted_length"] == 1.5
    assert spec_decode({url: _scrape(4, 8, 2)}, {url: _scrape(4, 8, 2)}, {url: "decode"}) == []
    assert mean_accepted_length({"spec_decode": []}) is None and mean_accepted_length(None) is None
