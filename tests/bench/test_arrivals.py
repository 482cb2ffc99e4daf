"""Acceptance 2: arrival processes. Poisson at 50 req/s over 1,000 requests has a mean
inter-arrival within 5% of 20 ms (measured on the actual sends), and gamma burstiness sets the
coefficient of variation of the gaps to 1/sqrt(burstiness)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pd_cluster.bench.arrival import gamma_gaps, rate_plan, step_windows, steps_count, steps_plan, trace_plan
from bench_testkit import bench, measure


def _gaps_of_sends(result) -> np.ndarray:
    starts = np.sort([r["started_s"] for r in result["requests"]])
    return np.diff(starts)


def _client_noise(res) -> list[str]:
    return list(res["summary"]["client"]["warnings"])


def _send_gaps_check(mean_s: float, cv: float, cv_rel: float):
    def check(res) -> str | None:
        if res["summary"]["completed"] != 1000:
            return f"{res['summary']['completed']} of 1000 completed"
        gaps = _gaps_of_sends(res)
        got_cv = gaps.std() / gaps.mean()
        if abs(gaps.mean() - mean_s) > 0.05 * mean_s or abs(got_cv - cv) > cv_rel * cv:
            return f"send gaps mean {gaps.mean() * 1e3:.2f} ms, CV {got_cv:.3f} (want {mean_s * 1e3:g} ms, {cv:.3f})"
        # the actual sends follow the plan: the median gap within 2 ms of the planned one
        planned = np.diff(np.sort([r["planned_s"] for r in res["requests"]]))
        off = np.percentile(np.abs(gaps - planned), 50)
        return None if off < 0.002 else f"median |actual - planned| gap {off * 1e3:.2f} ms"
    return check


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_poisson_sends_at_50_per_second_have_a_20ms_mean_gap(fake_factory):
    fake = fake_factory("--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", "2")
    run = lambda: bench(fake.url, "--dataset-name", "random", "--random-input-len", "8",  # noqa: E731
                        "--random-output-len", "2", "--num-prompts", "1000", "--request-rate", "50",
                        "--seed", "7", "--no-server-metrics")
    measure(run, _send_gaps_check(0.020, 1.0, 0.1), _client_noise)  # exponential gaps: CV 1


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_cv_of_actual_sends(fake_factory, burstiness):
    fake = fake_factory("--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", "2")
    run = lambda: bench(fake.url, "--dataset-name", "random", "--random-input-len", "8",  # noqa: E731
                        "--random-output-len", "2", "--num-prompts", "1000", "--request-rate", "100",
                        "--burstiness", str(burstiness), "--seed", "3", "--no-server-metrics")
    measure(run, _send_gaps_check(0.010, 1 / math.sqrt(burstiness), 0.15), _client_noise)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_gamma_gaps_have_the_specified_mean_and_cv(burstiness):
    gaps = gamma_gaps(200_000, rate=50.0, burstiness=burstiness, seed=1)
    assert gaps.mean() == pytest.approx(0.020, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


def test_rate_plan_is_exact_in_rate_and_seeded():
    a = rate_plan(1000, 50.0, 1.0, seed=5)
    b = rate_plan(1000, 50.0, 1.0, seed=5)
    c = rate_plan(1000, 50.0, 1.0, seed=6)
    assert a.times == b.times and a.times != c.times
    assert a.times[0] == 0.0 and a.times[-1] == pytest.approx(999 / 50.0)
    assert np.all(np.diff(a.times) >= 0)
    assert rate_plan(5, math.inf, 1.0, 0).times == (0.0,) * 5


def test_poisson_plan_gaps_are_exponential():
    """Kolmogorov-Smirnov distance of the planned gaps from Exp(mean 20 ms), n = 20,000."""
    gaps = np.sort(np.diff(rate_plan(20_001, 50.0, 1.0, seed=2).times))
    cdf = 1 - np.exp(-gaps / gaps.mean())
    n = len(gaps)
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert d < 1.63 / math.sqrt(n)  # the 1% critical value


def test_trace_plan_divides_gaps_by_the_speedup():
    plan = trace_plan([0.0, 3.0, 3.0, 9.0], speedup=3.0)
    assert plan.times == (0.0, 1.0, 1.0, 3.0)
    with pytest.raises(ValueError):
        trace_plan([1.0, 0.0], 1.0)


def test_rate_steps_send_each_steps_count_inside_the_step():
    steps = ((4.0, 10.0), (16.0, 5.0), (0.25, 2.0))  # the last rounds to 0.5 -> at least 1 request
    plan = steps_plan(steps, 1.0, seed=3)
    assert steps_count(steps) == 40 + 80 + 1 == len(plan.times)
    t = np.asarray(plan.times)
    assert np.all(np.diff(t) >= 0)
    first, second, third = t[:40], t[40:120], t[120:]
    assert first[0] == 0.0 and first[-1] == pytest.approx(39 / 4.0) and first[-1] < 10.0
    assert second[0] == 10.0 and second[-1] == pytest.approx(10.0 + 79 / 16.0) and second[-1] < 15.0
    assert third.tolist() == [15.0]
    assert step_windows(steps) == [(0.0, 10.0), (10.0, 15.0), (15.0, 17.0)]
    assert plan.kind.startswith("rate steps 4 req/s x 10 s, 16 req/s x 5 s")
    assert steps_plan(steps, 1.0, seed=3).times == plan.times != steps_plan(steps, 1.0, seed=4).times
