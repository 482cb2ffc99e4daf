"""Acceptance 4: goodput against a hand-computed set of records."""

from __future__ import annotations

import pytest
from bench_testkit import bench

from pd_cluster.bench.args import parse_goodput
from pd_cluster.bench.client import RequestRecord
from pd_cluster.bench.metrics import goodput


def _rec(i, ok, ttft, latency, out):
    r = RequestRecord(i, prompt_len=10, max_tokens=out, planned=0.0, sent=0.0, success=ok,
                      ttft=ttft, latency=latency, output_tokens=out)
    if not ok:
        r.reason = "HTTP 503"
    return r


# ttft s, latency s, output tokens -> TPOT = (latency - ttft) / (out - 1)
RECORDS = [
    _rec(0, True, 0.125, 1.0, 8),      # TPOT 125 ms, E2EL 1000: meets all three SLOs below
    _rec(1, True, 0.5, 1.5, 5),        # TTFT 500 ms: misses the TTFT SLO
    _rec(2, True, 0.0625, 0.0625, 1),  # one token: TPOT 0 (vLLM's rule): meets all
    _rec(3, False, 0.0, 0.01, 0),      # failed: never good
    _rec(4, True, 0.25, 3.25, 13),     # E2EL 3250 ms: misses the E2EL SLO
    _rec(5, True, 0.25, 2.0, 8),       # exactly on every bound (TPOT 250): meets all (<=)
]


def test_hand_computed_goodput():
    slos = parse_goodput(["ttft:250", "tpot:250", "e2el:2000"])
    assert slos == (("ttft", 250.0), ("tpot", 250.0), ("e2el", 2000.0))
    g = goodput(RECORDS, slos, duration_s=6.0)
    assert g["good_requests"] == 3  # records 0, 2, 5
    assert g["request_goodput"] == pytest.approx(0.5)
    assert g["goodput_share"] == pytest.approx(0.5)


@pytest.mark.parametrize("slo,good", [("tpot:200", 2), ("e2el:1500", 3), ("ttft:100", 1), ("ttft:10000", 5)])
def test_single_slos(slo, good):
    assert goodput(RECORDS, parse_goodput([slo]), 6.0)["good_requests"] == good


def test_bad_goodput_flags_are_rejected():
    for bad in (["ttft"], ["ttft:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_goodput_end_to_end_splits_on_the_fakes_ttft(fake_factory):
    fake = fake_factory("--ttft-ms", "60", "--itl-ms", "1", "--num-tokens", "4")
    base = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
            "--num-prompts", "40", "--request-rate", "200", "--no-server-metrics"]
    tight = bench(fake.url, *base, "--goodput", "ttft:40")["summary"]
    loose = bench(fake.url, *base, "--goodput", "ttft:5000", "tpot:1000")["summary"]
    assert tight["good_requests"] == 0 and tight["goodput_share"] == 0.0
    assert loose["good_requests"] == 40 and loose["goodput_share"] == 1.0
    assert loose["request_goodput"] == pytest.approx(40 / loose["duration_s"])
