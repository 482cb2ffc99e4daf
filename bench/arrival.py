"""Planned send times (seconds from the start of the run) for each request.

* ``inf``: every request at time 0.
* rate ``r`` with burstiness ``b``: gamma-distributed gaps with shape ``b`` and
  mean ``1/r`` (``b = 1`` is a Poisson process; the gaps' coefficient of
  variation is ``1/sqrt(b)``), as in ``vllm bench serve``. Like vLLM, the gaps
  are rescaled so that their sum is exactly ``(n - 1) / r``: the offered rate
  is then exact for every seed, and the shape of the process is unchanged.
* rate steps (``--rate-steps RATE:SECS ...``): one such process per step, for that step's seconds, one step
  after the other: ``round(RATE * SECS)`` requests in each, the first at the step's start (a load that
  changes, to watch an autoscaler react; DistServe's and Dynamo's planners are judged on such loads).
* trace: the trace's own timestamps divided by ``--trace-speedup``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalPlan:
    """``times[i]`` is when request ``i`` is due, seconds from the start; ``kind`` names the process."""

    times: tuple[float, ...]
    kind: str

    def describe(self) -> str:
        return self.kind


def gamma_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """``n`` gamma gaps (seconds, float64 ``[n]``) with mean ``1/rate`` and CV ``1/sqrt(burstiness)``."""
    rng = np.random.default_rng([seed, 11])
    theta = 1.0 / (rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n)


def rate_plan(n: int, rate: float, burstiness: float, seed: int) -> ArrivalPlan:
    """Send times of ``n`` requests at ``rate`` req/s (inf: all at once)."""
    if math.isinf(rate):
        return ArrivalPlan(tuple([0.0] * n), "rate=inf (all requests at once)")
    gaps = gamma_gaps(max(0, n - 1), rate, burstiness, seed)
    if gaps.size and gaps.sum() > 0:
        gaps *= (n - 1) / rate / gaps.sum()
    times = np.concatenate([[0.0], np.cumsum(gaps)]) if n else np.zeros(0)
    kind = "Poisson" if burstiness == 1.0 else f"gamma (burstiness {burstiness:g})"
    return ArrivalPlan(tuple(times.tolist()), f"rate={rate:g} req/s, {kind}")


def trace_plan(timestamps: list[float], speedup: float) -> ArrivalPlan:
    """Send times from trace timestamps (seconds), relative to the first, divided by ``speedup``.

    Raises ``ValueError`` when timestamps go backwards.
    """
    if not timestamps:
        return ArrivalPlan((), f"trace timestamps x{speedup:g}")
    t = np.asarray(timestamps, dtype=np.float64)
    if np.any(np.diff(t) < 0):
        raise ValueError("trace timestamps are not sorted")
    times = (t - t[0]) / speedup
    return ArrivalPlan(tuple(times.tolist()), f"trace timestamps, speedup x{speedup:g}")


def steps_count(steps: tuple[tuple[float, float], ...]) -> int:
    """Requests a rate-steps plan sends: ``round(rate * secs)`` per ``(rate, secs)`` step (at least 1 each)."""
    return sum(max(1, round(rate * secs)) for rate, secs in steps)


def steps_plan(steps: tuple[tuple[float, float], ...], burstiness: float, seed: int) -> ArrivalPlan:
    """Send times of `rate_plan` processes one after the other: step ``i`` (``(rate req/s, secs)``) sends
    ``round(rate * secs)`` requests (at least 1) from its start, which is the sum of the earlier steps' seconds.
    Its gaps are rescaled as `rate_plan`'s, so a step's requests all fall inside it."""
    times: list[float] = []
    start = 0.0
    for i, (rate, secs) in enumerate(steps):
        n = max(1, round(rate * secs))
        times += [start + t for t in rate_plan(n, rate, burstiness, seed + i).times]
        start += secs
    kind = "Poisson" if burstiness == 1.0 else f"gamma (burstiness {burstiness:g})"
    return ArrivalPlan(tuple(times), "rate steps " + ", ".join(f"{r:g} req/s x {s:g} s" for r, s in steps)
                       + f", {kind}")


def step_windows(steps: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """Each step's ``(start, end)`` in seconds from the run's start."""
    out, start = [], 0.0
    for _, secs in steps:
        out.append((start, start + secs))
        start += secs
    return out
