"""Acceptance 4: goodput against a hand-computed set of records; goodput per window of send time and per step of a
`--rate-steps` load."""

from __future__ import annotations

import pytest
from bench_testkit import bench

from pd_cluster.bench.args import build_parser, parse_goodput, to_config
from pd_cluster.bench.client import RequestRecord
from pd_cluster.bench.metrics import goodput, goodput_windows


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


def test_goodput_per_window_of_send_time():
    recs = [RequestRecord(i, prompt_len=10, max_tokens=4, planned=p, sent=p, success=True, ttft=ttft,
                          latency=ttft + 0.03, output_tokens=4)
            for i, (p, ttft) in enumerate([(0.0, 0.1), (1.5, 0.9), (2.0, 0.1), (3.9, 0.2), (4.0, 0.05)])]
    w = goodput_windows(recs, parse_goodput(["ttft:250"]), [(0.0, 2.0), (2.0, 4.0)])
    # [0, 2): 2 sent, 1 good; [2, 4]: 3 sent (4.0 is the last window's end), all good
    assert [(x["requests"], x["good_requests"]) for x in w] == [(2, 1), (3, 3)]
    assert [x["request_goodput"] for x in w] == [pytest.approx(0.5), pytest.approx(1.5)]


def test_rate_steps_and_window_flags_are_checked_and_named():
    def cfg(*flags):
        return to_config(build_parser().parse_args(list(flags)))

    c = cfg("--rate-steps", "4:10", "16:5", "--goodput", "ttft:300", "--goodput-window", "5")
    assert c.load.rate_steps == ((4.0, 10.0), (16.0, 5.0)) and c.dataset.num_prompts == 120
    assert c.report.goodput_window_s == 5.0
    assert cfg("--rate-steps", "4:10", "--num-prompts", "40").dataset.num_prompts == 40
    for flags, message in ((("--rate-steps", "4:10", "--num-prompts", "50"), "--num-prompts 50 conflicts"),
                           (("--rate-steps", "4:10", "--request-rate", "3"), "--rate-steps and --request-rate"),
                           (("--rate-steps", "4"), "--rate-steps: expected RATE:SECS"),
                           (("--rate-steps", "0:10"), "--rate-steps: 0:10"),
                           (("--rate-steps", "inf:10"), "--rate-steps: inf:10"),
                           (("--goodput-window", "5"), "--goodput-window needs --goodput"),
                           (("--goodput", "ttft:300", "--goodput-window", "0"), "--goodput-window must be > 0")):
        with pytest.raises(ValueError, match=message):
            cfg(*flags)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rate_steps_report_goodput_per_step_end_to_end(fake_factory):
    """pd-bench against the fake server: two steps, 20 requests in 0.4 s then 40 in 0.2 s; every one meets a
    loose TTFT SLO, so each step's goodput is its rate, and none meets a TTFT target below the fake's 60 ms."""
    fake = fake_factory("--ttft-ms", "60", "--itl-ms", "1", "--num-tokens", "4")
    flags = ["--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4", "--rate-steps",
             "50:0.4", "200:0.2", "--no-server-metrics"]
    s = bench(fake.url, *flags, "--goodput", "ttft:5000")["summary"]
    assert s["completed"] == 60 and s["good_requests"] == 60
    w = s["goodput_windows"]
    assert [(x["start_s"], x["end_s"], x["requests"], x["good_requests"]) for x in w] == \
        [(0.0, 0.4, 20, 20), (0.4, pytest.approx(0.6), 40, 40)]
    assert w[0]["request_goodput"] == pytest.approx(50.0) and w[1]["request_goodput"] == pytest.approx(200.0)
    tight = bench(fake.url, *flags, "--goodput", "ttft:40", "--goodput-window", "0.3")["summary"]
    w = tight["goodput_windows"]
    assert [(x["start_s"], x["end_s"]) for x in w] == [(0.0, 0.3), (0.3, 0.6)]
    assert 0 < w[0]["requests"] < 20 and w[0]["requests"] + w[1]["requests"] == 60  # step 1 spans 0-0.38 s
    assert [x["good_requests"] for x in w] == [0, 0]
