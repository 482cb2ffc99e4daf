"""Acceptance 1: against a fake server with exact delays (TTFT 50 ms, then 10 ms per token for
20 tokens), pd-bench reports TTFT, ITL and TPOT within 2 ms of the truth at p50 and 5 ms at p99,
at 10, 100 and inf requests/s.

The fake is the reference clock, so it runs in its own process with ``--realtime`` (SCHED_FIFO
where the OS allows it): on a machine busy with other work its timers would otherwise fire
late and the "truth" itself would drift. pd-bench runs at normal priority. Connections are
opened by a warm-up so that every timed request measures the server, not TCP set-up."""

from __future__ import annotations

import pytest

from bench_testkit import bench, measure, timer_stats

TRUTH_MS = {"ttft": 50.0, "itl": 10.0, "tpot": 10.0}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rate,num", [("10", 150), ("100", 500), ("inf", 50)])
def test_reported_latencies_match_the_fake_servers_delays(fake_factory, rate, num):
    fakes = []

    def run():  # a fresh fake per attempt, so its timer statistics cover this attempt alone
        fakes.append(fake_factory("--ttft-ms", "50", "--itl-ms", "10", "--num-tokens", "20", realtime=True))
        return bench(fakes[-1].url, "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "64",
                     "--num-prompts", str(num), "--request-rate", rate, "--warmup-requests", str(min(num, 50)),
                     "--metric-percentiles", "50,99", "--no-server-metrics", "--request-timeout", "30")

    def check(res) -> str | None:
        s = res["summary"]
        if s["completed"] != num or s["failed"] != 0:
            return f"{s['completed']} completed, {s['failed']} failed"
        if s["total_output_tokens"] != 20 * num:  # the fake's EOS after 20 tokens, counted from usage
            return f"{s['total_output_tokens']} output tokens"
        errors = {f"{m} p{p}": s[f"p{p}_{m}_ms"] - truth for m, truth in TRUTH_MS.items() for p in (50, 99)}
        too_far = {k: round(v, 2) for k, v in errors.items() if abs(v) > (2.0 if k.endswith("p50") else 5.0)}
        return f"rate {rate}: errors beyond the bounds (ms): {too_far}" if too_far else None

    def noise(res) -> list[str]:
        t = timer_stats(fakes[-1].url)
        fake_late = [f"fake timers late p99 {t['p99_ms']:.2f} ms, max {t['max_ms']:.1f} ms "
                     f"(scheduling: {fakes[-1].scheduling})"] if t["p99_ms"] > 1.0 else []
        return list(res["summary"]["client"]["warnings"]) + fake_late

    measure(run, check, noise)
