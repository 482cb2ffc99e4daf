"""A DP-attention decode instance's ``/metrics``: every rank's registry in one exposition, each sample labelled
``dp_rank``, each family once (real `prometheus_client` registries rendered and parsed back)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.decode.dp_metrics import merge_rank_metrics


def _rank(running: int, received: float, ttfts: list[float]) -> str:
    reg = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Requests running", ["model_name"], registry=reg).labels("m").set(running)
    Counter("pd:kv_transfer_received_bytes", "KV bytes received", registry=reg).inc(received)
    h = Histogram("vllm:time_to_first_token_seconds", "TTFT", ["model_name"], buckets=(0.1, 1.0), registry=reg)
    for t in ttfts:
        h.labels("m").observe(t)
    return generate_latest(reg).decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if not s.name.endswith("_created")}


def test_every_rank_s_samples_come_back_under_its_dp_rank_and_each_family_once():
    texts = [_rank(3, 1000, [0.05, 0.5]), None, _rank(5, 2500, [2.0])]  # rank 1 did not answer
    merged = merge_rank_metrics(texts).decode()
    got = _samples(merged)
    for rank, text in ((0, texts[0]), (2, texts[2])):
        for (name, labels), value in _samples(text).items():
            assert got[(name, tuple(sorted(dict(labels, dp_rank=str(rank)).items())))] == value
    assert not any(dict(labels).get("dp_rank") == "1" for _, labels in got)
    assert got[("vllm:num_requests_running", (("dp_rank", "2"), ("model_name", "m")))] == 5
    assert got[("vllm:time_to_first_token_seconds_bucket", (("dp_rank", "0"), ("le", "1.0"), ("model_name", "m")))] == 2
    assert merged.count("# TYPE vllm:time_to_first_token_seconds histogram") == 1
    assert merged.count("# TYPE pd:kv_transfer_received_bytes_total counter") == 1


def test_a_rank_whose_text_is_not_prometheus_is_left_out():
    merged = _samples(merge_rank_metrics([_rank(1, 10, []), "this is { not prometheus"]).decode())
    assert merged and {dict(labels)["dp_rank"] for _, labels in merged} == {"0"}
