"""The fake worker's emulated prefix cache: exact, unbounded, full pages only.

Each prompt (as the fake counts its tokens: the ``--tokenizer``'s ids, else whitespace-separated
words) is cut into pages of ``--page-size`` units; a page hits when the same chain of pages from
the start of the prompt was seen before, as in vLLM's chained block hashes. As in vLLM, the last
prompt token is never served from the cache (it is recomputed to get logits), so only the full
pages of the first ``n - 1`` units can hit. The counts are exported as
``pd:prefix_cache_{queries,hits}_total`` and vLLM's ``vllm:prefix_cache_{queries,hits}_total``.
"""

from __future__ import annotations

from typing import Hashable, Sequence


class FakePrefixCache:
    """An unbounded set of page chains. ``page_size`` units per page (>= 1)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = max(1, page_size)
        self._chains: set[Hashable] = set()

    def lookup_and_insert(self, units: Sequence[Hashable]) -> int:
        """Units of ``units`` served from the cache (a multiple of ``page_size``); then caches every full page."""
        ps, hits, key = self.page_size, 0, ()
        usable = (len(units) - 1) // ps if units else 0
        for p in range(len(units) // ps):
            key = hash((key, tuple(units[p * ps:(p + 1) * ps])))
            if p < usable and hits == p * ps and key in self._chains:
                hits += ps
            self._chains.add(key)
        return hits
