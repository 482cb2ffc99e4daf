"""A quantile of a Prometheus histogram from its cumulative buckets, as Prometheus' ``histogram_quantile`` does:
linear interpolation inside the bucket that holds the rank, from 0 for the first bucket; a rank in the ``+Inf``
bucket gives the largest finite bound.

Shared by ``pd-bench``'s server-side breakdown (`pd_cluster.bench.prom`) and the planner's scrape
(`pd_cluster.planner.scrape`). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The `q` quantile (0..1) of `buckets`, ``(upper bound, cumulative count)`` sorted by bound (``+Inf`` last);
    None when the histogram holds no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_cum = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank and cum > prev_cum:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_cum) / (cum - prev_cum)
        prev_le, prev_cum = le, cum
    return prev_le
