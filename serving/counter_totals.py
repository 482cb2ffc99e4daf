"""Prometheus counters fed from an engine's running totals (`engine.stats`), read once per step."""

from __future__ import annotations

from prometheus_client import Counter


class CounterTotals:
    """Each `add` increments a counter by what its total grew since the last `add` under the same key; a total
    that did not grow (or went back, e.g. a restarted tier's stats) adds nothing."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def add(self, counter: Counter, key: str, total: float) -> None:
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total
