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
against load). When every candidate's :class:`~pd_cluster.router.kv_index.KvIndex`
entry is fresh, and the request carries its token ids (``--tokenizer-path``) or
the workers' text-to-page map of its page size is usable
(:class:`~pd_cluster.router.text_map.TextMap`: the prompt's text blocks name
pages, `TextPages`), the tree is not consulted. While the loads are balanced
(the tree's ``balance_abs_threshold`` / ``balance_rel_threshold``, as SGLang's
router), the worker holding the most of the prompt wins if it holds more than
``cache_threshold`` of it (of its pages; of an untokenized prompt's characters,
`TextPages`) (ties: the lower load), else the least loaded worker
holding the fewest pages; once the loads are imbalanced each worker costs

    cost = overlap_score_weight x (1 - matched fraction) + load

where the matched fraction is ``cached_pages / prompt_pages``, the prompt's
leading full pages the worker holds (reported by its KV events, or pending from
a request routed there since the last poll) over its full pages (for an
untokenized prompt: the characters up to its deepest held text block over its
characters), and ``load`` is
:func:`~pd_cluster.router.policies.base.live_load` in requests. The lowest
cost wins; ties go to the lower load, then to the worker holding fewer pages.
Pages some worker wrote to the cluster-wide KV store (``--hicache-storage-backend``; their ``"L3"`` KV events)
count for every worker at `L3_HIT_WEIGHT` of a page it holds itself: reading them is cheaper than computing
them, but not free, so a worker that holds a prefix still wins it while loads are balanced, and a busy one loses
less by sending it elsewhere (llm-d's precise prefix scorer weighs its tiers the same way).
Otherwise the tree decides (the fallback), and records the prompts it routes;
while the events route, the pending text blocks (`KvIndex.predict_text`) stand
in for it, so a prompt costs one pass of block hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pd_cluster.common.routing_text import MAX_CHARS, block_chars_for, block_hashes

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
from pd_cluster.router.text_map import TextMap


HASHED_CHARS = 1 << 22
"""Characters of recent prompts whose block hashes are remembered (a repeated prompt is hashed once)."""


FINGERPRINT_CHARS = 64
"""Characters at each end of a text that key its remembered block hashes (with its length and the page size)."""


L3_HIT_WEIGHT = 0.5
"""What a page in the cluster-wide KV store counts for, against one in the worker's own cache (1) or a miss (0)."""


class CacheAware(Policy):
    """The ``cache_aware`` policy.

    Counts its decisions in ``hits``, ``misses``, ``balanced`` (a hit: the chosen worker holds part of the
    prompt, by the tree or by its events), and by source in ``by_events`` and ``by_tree``.
    ``index``: the workers' KV event index (None: the tree only). ``text_map``: what the workers' text-to-page
    maps said (untokenized prompts are scored on the index through it; None: only prompts with token ids are).
    """

    name = "cache_aware"
    needs_load = True

    def __init__(self, config: CacheAwareConfig, clock: Callable[[], float], index: KvIndex | None = None,
                 kv: KvRoutingConfig | None = None, text_map: TextMap | None = None) -> None:
        self.config = config
        self.kv = kv or KvRoutingConfig()
        self.index = index
        self.text_map = text_map
        self._clock = clock
        self.tree = ApproxPrefixTree(config.block_chars, config.max_tree_size, clock)
        self.hits = 0
        self.misses = 0
        self.balanced = 0
        self.by_events = 0
        self.by_tree = 0
        self._routed: tuple[RouteRequest | None, float, TextPages | None] = (None, 0.0, None)
        self._hashed: OrderedDict[tuple[int, str, str, int], tuple[str, list[int]]] = OrderedDict()
        self._hashed_chars = 0

    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        require_candidates(candidates)
        now = self._clock()
        if self._events_usable(candidates, request, now):
            self.by_events += 1
            if request.prompt is not None:
                prompt = request.prompt
                return self._by_kv_state(candidates, lambda c: _page_match(
                    self.index.cached_pages(c.url, prompt), self.index.l3_pages(c.url, prompt)))
            pages = TextPages(self, request.text)
            self._routed = (request, now, pages)
            return self._by_kv_state(candidates, pages)
        self.by_tree += 1
        hashes = self.tree.path_hashes(request.text)
        loads = [effective_load(c) for c in candidates]
        if self._imbalanced(loads):
            self.balanced += 1
            choice = self._least_loaded(candidates, loads, None)
        else:
            choice = self._by_prefix(candidates, loads, hashes, len(request.text))
        if hashes:
            self.tree.insert(hashes, choice.url, now)
        return choice

    def hashes(self, text: str, page_size: int) -> list[int]:
        """`block_hashes` of `text` in the text maps' blocks for `page_size`, remembered for the most recent texts
        (a repeated prompt is hashed once). The memo is keyed by a fingerprint (the length, the first and last
        `FINGERPRINT_CHARS` characters and the page size: hashing a whole prompt to key it cost as much as a
        tenth of its block hashes), and a hit is checked against the whole text."""
        key = (len(text), text[:FINGERPRINT_CHARS], text[-FINGERPRINT_CHARS:], page_size)
        cache = self._hashed
        got = cache.get(key)
        if got is not None:
            if got[0] == text:
                cache.move_to_end(key)
                return got[1]
        hashes = block_hashes(text, block_chars_for(page_size))
        cache[key] = (text, hashes)
        if got is not None:  # another text with the same fingerprint took its slot
            self._hashed_chars -= len(got[0])
            cache.move_to_end(key)
        self._hashed_chars += len(text)
        while self._hashed_chars > HASHED_CHARS and cache:
            _, (old, _) = cache.popitem(last=False)
            self._hashed_chars -= len(old)
        return hashes

    def _events_usable(self, candidates: Sequence[Candidate], request: RouteRequest, now: float) -> bool:
        index = self.index
        if index is None:
            return False
        if request.prompt is None:
            if self.text_map is None or not request.text:
                return False
            for c in candidates:
                w = index.get(c.url)
                if w is None or not index.fresh(c.url, now) or not self.text_map.fresh(w.page_size, now):
                    return False
            return True
        return all(index.fresh(c.url, now) for c in candidates)

    def _by_kv_state(self, candidates: Sequence[Candidate],
                     matched: Callable[[Candidate], tuple[float, int]]) -> Candidate:
        """The choice on the workers' KV state; ``matched(c)``: (the fraction of the prompt `c` holds, 0..1, with
        what the cluster-wide KV store holds beyond it at `L3_HIT_WEIGHT`; the leading pages of it that `c`
        holds)."""
        index, weight = self.index, self.kv.overlap_score_weight
        loads = [live_load(c) for c in candidates]
        fractions = [matched(c) for c in candidates]
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
        """Count the prompt's pages as pending on `choice` (see `KvIndex.predict`; an untokenized prompt: its text
        blocks, `KvIndex.predict_text`); returns what to call when the worker's part of the request has ended."""
        if self.index is None:
            return None
        if request.prompt is None:
            routed, at, pages = self._routed
            w = self.index.get(choice.url)
            if routed is not request or w is None or w.page_size < 1:  # routed by the tree
                return None
            route = self.index.predict_text(choice.url, pages.hashes(w.page_size), at)
            return None if route is None else (lambda: KvIndex.done(route, self._clock()))
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


def _page_match(cached_total: tuple[int, int], stored: int = 0) -> tuple[float, int]:
    """(fraction, pages) of a tokenized prompt from `KvIndex.cached_pages`' (held pages, the prompt's pages) and
    the leading pages of it in the cluster-wide KV store (`KvIndex.l3_pages`), those beyond the held ones at
    `L3_HIT_WEIGHT` (read from the store, not computed)."""
    cached, total = cached_total
    held = cached + L3_HIT_WEIGHT * max(stored - cached, 0)
    return (min(1.0, held / total) if total else 0.0, cached)


class TextPages:
    """The match of an untokenized prompt (its routing `text`) on each worker: the leading mapped pages it holds
    (its block hashes for the worker's page size, `TextMap.lookup`, then the worker's `KvIndex` entry), or, when
    more, the pages of the leading blocks routed to it and still pending (`RecentText`: its events may not say
    yet).

    The fraction is of the text, in characters, as SGLang's router measures its match: the deepest held block
    ends at a known character, while the prompt's pages are only estimated from the sources' mean characters per
    token, which a text unlike the others' misjudges (a held page at 42% of the text counted as 1 of 4 estimated
    pages fell below ``cache_threshold`` and the continuation went elsewhere)."""

    __slots__ = ("policy", "text", "_by_size", "_stored")

    def __init__(self, policy: CacheAware, text: str) -> None:
        self.policy = policy
        self.text = text
        self._by_size: dict[int, tuple[list[int], list[tuple[int, int, int]], int, float]] = {}
        self._stored: dict[int, int] = {}  # page size -> `_stored_blocks`

    def hashes(self, page_size: int) -> list[int]:
        """The text's block hashes for `page_size` (`CacheAware.hashes`; those the match used, when it did)."""
        got = self._by_size.get(page_size)
        return got[0] if got is not None else self.policy.hashes(self.text, page_size)

    def _resolved(self, page_size: int) -> tuple[list[int], list[tuple[int, int, int]], int, float]:
        got = self._by_size.get(page_size)
        if got is None:
            policy = self.policy
            tmap = policy.text_map
            hashes = policy.hashes(self.text, page_size)
            resolved = tmap.lookup(page_size, hashes)
            chars_per_page = tmap.chars_per_token(page_size) * page_size
            whole = len(self.text) <= MAX_CHARS  # the last hash names the whole text
            if whole and resolved and resolved[-1][0] == len(hashes) - 1:
                total = resolved[-1][2]
            else:
                total = max(int(len(self.text) / chars_per_page), resolved[-1][2] if resolved else 0)
            got = self._by_size[page_size] = (hashes, resolved, total, chars_per_page)
        return got

    def __call__(self, c: Candidate) -> tuple[float, int]:
        w = self.policy.index.get(c.url)
        if w is None or w.page_size < 1 or not self.text:
            return 0.0, 0
        hashes, resolved, total, chars_per_page = self._resolved(w.page_size)
        block = block_chars_for(w.page_size)
        cached = blocks = 0
        for k, page, pages in resolved:
            if not w.holds(page):
                break
            cached, blocks = pages, k + 1
        if w.text.routes:
            depth = w.text.depth(hashes)
            if depth == len(hashes):
                return 1.0, total
            if depth > blocks:
                cached = max(cached, min(total, int(depth * block / chars_per_page)))
                blocks = depth
        stored = self._stored.get(w.page_size)
        if stored is None:
            stored = self._stored[w.page_size] = self._stored_blocks(resolved)
        held = blocks + L3_HIT_WEIGHT * max(stored - blocks, 0)  # read from the store, not computed
        return min(1.0, held * block / len(self.text)), cached

    def _stored_blocks(self, resolved: list[tuple[int, int, int]]) -> int:
        """Leading text blocks whose mapped pages some worker wrote to the cluster-wide KV store (`KvIndex.l3`)."""
        l3 = self.policy.index.l3
        blocks = 0
        if l3:
            for k, page, _ in resolved:
                if page not in l3:
                    break
                blocks = k + 1
        return blocks
