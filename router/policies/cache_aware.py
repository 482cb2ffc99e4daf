"""Cache-aware routing: send a prompt where its prefix was sent before.

Semantics of SGLang's ``cache_aware`` router policy:

1. If the load is imbalanced (``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``), take the least loaded worker.
2. Else, if the longest prefix match covers more than ``cache_threshold`` of
   the prompt, take the matching worker (the least loaded one on a tie).
3. Else take the least loaded worker; ties go to the worker whose tree holds
   the least, which spreads new prefixes over the fleet.

The chosen worker's tree then records the prompt. Load is
:func:`pd_cluster.router.policies.base.effective_load`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pd_cluster.router.config import CacheAwareConfig
from pd_cluster.router.policies.base import Candidate, Policy, RouteRequest, effective_load, require_candidates
from pd_cluster.router.policies.prefix_tree import ApproxPrefixTree


class CacheAware(Policy):
    """The ``cache_aware`` policy; counts its decisions in ``hits``, ``misses``, ``balanced``."""

    name = "cache_aware"
    needs_load = True

    def __init__(self, config: CacheAwareConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.tree = ApproxPrefixTree(config.block_chars, config.max_tree_size, clock)
        self.hits = 0
        self.misses = 0
        self.balanced = 0

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        loads = [effective_load(c) for c in candidates]
        hashes = self.tree.path_hashes(request.text)
        if self._imbalanced(loads):
            self.balanced += 1
            choice = self._least_loaded(candidates, loads, None)
        else:
            choice = self._by_prefix(candidates, loads, hashes, len(request.text))
        if hashes:
            self.tree.insert(hashes, choice.url)
        return choice

    def _by_prefix(self, candidates: Sequence[Candidate], loads: list[int],
                   hashes: list[int], text_len: int) -> Candidate:
        best, depth = self.tree.match(hashes, (c.url for c in candidates))
        matched = min(text_len, depth * self.tree.block_chars)
        if best and text_len and matched / text_len > self.config.cache_threshold:
            self.hits += 1
            return self._least_loaded(candidates, loads, best)
        self.misses += 1
        return self._least_loaded(candidates, loads, None)

    def _imbalanced(self, loads: list[int]) -> bool:
        lo, hi = min(loads), max(loads)
        cfg = self.config
        return hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold

    def _least_loaded(self, candidates: Sequence[Candidate], loads: list[int],
                      among: set[str] | None) -> Candidate:
        best_key = None
        best = candidates[0]
        for c, load in zip(candidates, loads):
            if among is not None and c.url not in among:
                continue
            key = (load, self.tree.tenant_size(c.url))
            if best_key is None or key < best_key:
                best_key, best = key, c
        return best

    @property
    def hit_ratio(self) -> float:
        """Hits over all decisions so far (0 before the first)."""
        total = self.hits + self.misses + self.balanced
        return self.hits / total if total else 0.0

    def on_worker_removed(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def evict(self) -> None:
        """Drop entries idle longer than the eviction interval."""
        self.tree.evict_idle(self.config.eviction_interval_secs)
