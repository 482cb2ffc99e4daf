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

**On the workers' real cache state** (NVIDIA Dynamo's KV router: overlap
against load). When the request carries its token ids (``--tokenizer-path``)
and every candidate's :class:`~pd_cluster.router.kv_index.KvIndex` entry is
fresh, the tree is not consulted. While the loads are balanced (the tree's
``balance_abs_threshold`` / ``balance_rel_threshold``, as SGLang's router), the
worker holding the most of the prompt wins if it holds more than
``cache_threshold`` of it (ties: the lower load), else the least loaded worker
holding the fewest pages; once the loads are imbalanced each worker costs

    cost = overlap_score_weight x (1 - cached_pages / prompt_pages) + load

where ``cached_pages`` are the prompt's leading full pages the worker holds
(reported by its KV events, or pending from a request routed there since the
last poll), ``prompt_pages`` the prompt's full pages, and ``load`` is
:func:`~pd_cluster.router.policies.base.live_load` in requests. The lowest
cost wins; ties go to the lower load, then to the worker holding fewer pages.
Pages some worker wrote to the cluster-wide KV store (``--hicache-storage-backend``; their ``"L3"`` KV events)
count for every worker at `L3_HIT_WEIGHT` of a page it holds itself: reading them is cheaper than computing
them, but not free, so a worker that holds a prefix still wins it while loads are balanced, and a busy one loses
less by sending it elsewhere (llm-d's precise prefix scorer weighs its tiers the same way).
Otherwise the tree decides (the fallback). The tree records every prompt either
way, so it is warm when events lag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pd_cluster.router.config import CacheAwareConfig, KvRoutingConfig
from pd_cluster.router.kv_index import KvIndex, PromptTokens
from pd_cluster.router.policies.base import (
    Candidate,
    Policy,
    RouteRequest,
    effective_load,
    live_load,
    require_candidates,
)
from pd_cluster.router.policies.prefix_tree import ApproxPrefixTree


L3_HIT_WEIGHT = 0.5
"""What a page in the cluster-wide KV store counts for, against one in the worker's own cache (1) or a miss (0)."""


class CacheAware(Policy):
    """The ``cache_aware`` policy.

    Counts its decisions in ``hits``, ``misses``, ``balanced`` (a hit: the chosen worker holds part of the
    prompt, by the tree or by its events), and by source in ``by_events`` and ``by_tree``.
    ``index``: the workers' KV event index (None: the tree only).
    """

    name = "cache_aware"
    needs_load = True

    def __init__(self, config: CacheAwareConfig, clock: Callable[[], float], index: KvIndex | None = None,
                 kv: KvRoutingConfig | None = None) -> None:
        self.config = config
        self.kv = kv or KvRoutingConfig()
        self.index = index
        self._clock = clock
        self.tree = ApproxPrefixTree(config.block_chars, config.max_tree_size, clock)
        self.hits = 0
        self.misses = 0
        self.balanced = 0
        self.by_events = 0
        self.by_tree = 0

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        hashes = self.tree.path_hashes(request.text)
        if self._events_usable(candidates, request):
            self.by_events += 1
            choice = self._by_kv_state(candidates, request.prompt)
        else:
            self.by_tree += 1
            loads = [effective_load(c) for c in candidates]
            if self._imbalanced(loads):
                self.balanced += 1
                choice = self._least_loaded(candidates, loads, None)
            else:
                choice = self._by_prefix(candidates, loads, hashes, len(request.text))
        if hashes:
            self.tree.insert(hashes, choice.url)
        return choice

    def _events_usable(self, candidates: Sequence[Candidate], request: RouteRequest) -> bool:
        if self.index is None or request.prompt is None:
            return False
        now = self._clock()
        return all(self.index.fresh(c.url, now) for c in candidates)

    def _by_kv_state(self, candidates: Sequence[Candidate], prompt: PromptTokens) -> Candidate:
        index, weight = self.index, self.kv.overlap_score_weight
        loads = [live_load(c) for c in candidates]
        fractions = []
        for c in candidates:
            cached, total = index.cached_pages(c.url, prompt)
            stored = max(index.l3_pages(c.url, prompt) - cached, 0)  # read from the store, not computed
            fractions.append(((cached + L3_HIT_WEIGHT * stored) / total if total else 0.0, cached))
        # SGLang's rule on the real match: balanced loads and a match above cache_threshold: the best match
        balanced = not self._imbalanced(loads)
        by_match = balanced and max(f for f, _ in fractions) > self.config.cache_threshold
        best, best_key, best_cached = candidates[0], None, 0
        for c, load, (fraction, cached) in zip(candidates, loads, fractions):
            if by_match:
                cost = 1.0 - fraction
            elif balanced:
                cost = 0.0  # no worker holds enough of it: the least loaded, then the one holding fewest pages
            else:
                cost = weight * (1.0 - fraction) + load
            key = (cost, load, index.num_pages(c.url))
            if best_key is None or key < best_key:
                best, best_key, best_cached = c, key, cached
        if best_cached:
            self.hits += 1
        else:
            self.misses += 1
        return best

    def track(self, choice: Candidate, request: RouteRequest) -> Callable[[], None] | None:
        """Count the prompt's pages as pending on `choice` (see `KvIndex.predict`); returns what to call when
        the worker's part of the request has ended."""
        if self.index is None or request.prompt is None:
            return None
        w = self.index.get(choice.url)
        if w is None or w.page_size < 1:
            return None
        route = self.index.predict(choice.url, request.prompt.hashes(w.page_size))
        if route is None:
            return None
        return lambda: KvIndex.done(route, self._clock())

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
        if self.index is not None:
            self.index.forget(url)

    def evict(self) -> None:
        """Drop entries idle longer than the eviction interval."""
        self.tree.evict_idle(self.config.eviction_interval_secs)
