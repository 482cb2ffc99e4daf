"""Prometheus text parsing and the arithmetic on scrapes that the breakdown needs.

A scrape is ``{(sample_name, ((label, value), ...)): value}``. Deltas between
two scrapes of counters and histograms give what happened in between; a
histogram's quantile is estimated from its bucket deltas as Prometheus'
``histogram_quantile`` does (linear within the bucket that holds the rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.common.histogram import histogram_quantile

Labels = tuple[tuple[str, str], ...]
Scrape = dict[tuple[str, Labels], float]


def parse(text: str) -> Scrape:
    """Every sample of a Prometheus text exposition. Raises ``ValueError`` on malformed text."""
    out: Scrape = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def has_prefix(scrape: Scrape, prefix: str) -> bool:
    return any(name.startswith(prefix) for name, _ in scrape)


def delta_sum(before: Scrape, after: Scrape, name: str) -> float:
    """Increase of ``name`` summed over all its label sets (counter resets count from zero)."""
    total = 0.0
    for (n, labels), v in after.items():
        if n == name:
            prev = before.get((n, labels), 0.0)
            total += v - prev if v >= prev else v
    return total


def delta_by_label(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    """Increase of ``name`` per value of ``label``."""
    out: dict[str, float] = {}
    for (n, labels), v in after.items():
        if n == name:
            prev = before.get((n, labels), 0.0)
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + (v - prev if v >= prev else v)
    return out


def gauge(scrape: Scrape, name: str) -> float | None:
    vals = [v for (n, _), v in scrape.items() if n == name]
    return max(vals) if vals else None


@dataclass
class HistogramDelta:
    """What a histogram recorded between two scrapes: cumulative ``buckets`` as ``(le, count)``."""

    buckets: list[tuple[float, float]]
    sum: float
    count: float

    def merged(self, other: "HistogramDelta") -> "HistogramDelta":
        """Adds another worker's delta (bucket bounds are merged; counts at a missing bound
        are taken from the next lower bound, which is exact for identical layouts)."""
        les = sorted({le for le, _ in self.buckets} | {le for le, _ in other.buckets})
        return HistogramDelta([(le, _cum_at(self.buckets, le) + _cum_at(other.buckets, le)) for le in les],
                              self.sum + other.sum, self.count + other.count)

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan

    def quantile(self, q: float) -> float:
        """Prometheus ``histogram_quantile(q)`` on these buckets (NaN when empty)."""
        if self.count <= 0:
            return math.nan
        value = histogram_quantile(q, self.buckets)
        return math.nan if value is None else value


def _cum_at(buckets: list[tuple[float, float]], le: float) -> float:
    best = 0.0
    for b, c in buckets:
        if b <= le:
            best = c
    return best


def histogram_delta(before: Scrape, after: Scrape, base: str) -> HistogramDelta | None:
    """The delta of histogram ``base`` (all label sets but ``le`` summed); None when absent."""
    per_le: dict[float, float] = {}
    for (n, labels), v in after.items():
        if n == base + "_bucket":
            le_text = dict(labels).get("le", "+Inf")
            le = math.inf if le_text in ("+Inf", "Inf") else float(le_text)
            prev = before.get((n, labels), 0.0)
            per_le[le] = per_le.get(le, 0.0) + (v - prev if v >= prev else v)
    if not per_le:
        return None
    return HistogramDelta(sorted(per_le.items()), delta_sum(before, after, base + "_sum"),
                          delta_sum(before, after, base + "_count"))
