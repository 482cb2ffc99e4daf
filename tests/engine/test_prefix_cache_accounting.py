"""Stateful property test of the page accounting with the prefix cache (PyPI ``hypothesis``).

Random admits (with prefix matching), prefill chunks, decode tokens, finishes,
aborts, retractions and evictions drive the real `PageManager` and `PrefixCache`
over a tiny pool. A simple model keeps what each page must hold: the KV at
position ``p`` of a sequence is modelled as its whole token prefix ``tokens[:p+1]``
(what real KV depends on). After every step:

- free + evictable + in use == total, and every page's reference count is the
  number of requests holding it plus one if cached;
- no page a live request holds is free, and a newly granted page was held by
  no one (nothing referenced is ever freed or reused);
- a request only writes into pages nobody else holds, and a cache hit always
  serves pages whose modelled KV is exactly the request's own prefix.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator
from pd_cluster.engine.kv.prefix_cache import PrefixCache
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.scheduler.page_manager import PageManager

NUM_PAGES = 12
PAGE_SIZE = 2
PARAMS = SamplingParams(max_tokens=64)
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a tiny vocabulary: prefixes collide often


class PageAccounting(RuleBasedStateMachine):
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.cache = PrefixCache(self.alloc, PAGE_SIZE)
        self.pages = PageManager(self.alloc, PAGE_SIZE, self.cache)
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}  # page -> offset -> modelled KV (the token prefix)
        self.reqs: dict[str, Request] = {}
        self.next_id = 0

    # ---- helpers ------------------------------------------------------------------------
    def _held_by_others(self, page: int, req: Request) -> bool:
        return any(page in self._refs(r) for r in self.reqs.values() if r is not req)

    def _refs(self, req: Request) -> list[int]:
        chain = self.pages._chains.get(req.request_id)
        return req.block_table + (chain.anchors if chain else [])

    def _grow(self, req: Request, num_tokens: int) -> bool:
        if not self.pages.can_grow(req, num_tokens):
            return False
        before = {p for r in self.reqs.values() for p in self._refs(r)}
        cached_before = set(self.cache._by_page)
        new = self.pages.grow(req, num_tokens)
        for p in new:
            assert p != NULL_PAGE and p not in before, f"page {p} granted while held"
            assert p not in self.cache._by_page, f"page {p} granted while cached"
            if p in cached_before:  # it was evicted to make room: its old content is gone
                self.kv.pop(p, None)
            self.kv[p] = {}
        return True

    def _compute(self, req: Request, n: int) -> None:
        """Write the modelled KV of the next `n` tokens, as a forward pass would."""
        end = min(req.num_computed_tokens + n, req.num_tokens)
        if end <= req.num_computed_tokens or not self._grow(req, end):
            return
        for pos in range(req.num_computed_tokens, end):
            page = req.block_table[pos // PAGE_SIZE]
            assert not self.cache.is_cached(page) and not self._held_by_others(page, req), \
                f"write into shared page {page}"
            self.kv[page][pos % PAGE_SIZE] = tuple(req.token_ids[:pos + 1])
        req.num_computed_tokens = end
        self.pages.cache_computed(req)

    def _match(self, req: Request) -> None:
        cached = self.pages.match(req)
        req.num_computed_tokens = cached
        assert cached <= req.num_tokens - 1 and cached % PAGE_SIZE == 0
        for pos in range(cached):
            page = req.block_table[pos // PAGE_SIZE]
            assert self.kv[page][pos % PAGE_SIZE] == tuple(req.token_ids[:pos + 1]), "cache hit served wrong KV"

    # ---- rules ----------------------------------------------------------------------------
    @rule(target=live, tokens=tokens_st, chunk=st.integers(1, 5))
    def admit(self, tokens, chunk):
        req = Request(f"r{self.next_id}", tokens, PARAMS)
        self.next_id += 1
        self._match(req)
        self.reqs[req.request_id] = req
        self._compute(req, chunk)
        return req.request_id

    @rule(rid=live, n=st.integers(1, 4))
    def prefill_chunk(self, rid, n):
        if rid in self.reqs:
            self._compute(self.reqs[rid], n)

    @rule(rid=live, token=st.integers(0, 2))
    def decode(self, rid, token):
        req = self.reqs.get(rid)
        if req is not None and req.num_computed_tokens == req.num_tokens - 1:
            self._compute(req, 1)
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(token)  # sampled from the logits of the last computed token

    @rule(rid=consumes(live))
    def finish_or_abort(self, rid):
        req = self.reqs.pop(rid, None)
        if req is not None:
            self.pages.release(req)

    @rule(rid=live)
    def retract(self, rid):
        req = self.reqs.get(rid)
        if req is not None:
            self.pages.release(req)
            req.num_computed_tokens = 0
            self._match(req)  # re-admitted later: starts again on its cached prefix
            self._compute(req, 3)

    @rule(n=st.integers(1, NUM_PAGES))
    def evict(self, n):
        expected = min(n, self.cache.num_evictable)
        assert self.cache.evict(n) == expected

    @precondition(lambda self: self.cache.num_evictable > 0)
    @rule()
    def evict_all(self):
        n = self.cache.num_evictable
        assert self.cache.evict(NUM_PAGES) == n  # every evictable page can be reached, leaves first
        assert self.cache.num_evictable == 0

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def pages_add_up(self):
        held: dict[int, int] = {}
        for r in self.reqs.values():
            for p in self._refs(r):
                held[p] = held.get(p, 0) + 1
        cached = set(self.cache._by_page)
        evictable = cached - set(held)
        assert self.alloc.num_free + self.cache.num_evictable + self.pages.num_in_use == NUM_PAGES
        assert self.cache.num_evictable == len(evictable)
        assert self.pages.num_in_use == len(set(held) | (cached - evictable)) == len(held)
        for p in range(1, NUM_PAGES + 1):
            assert self.alloc.refcount(p) == held.get(p, 0) + (p in cached), p
        assert len(self.alloc._free) == self.alloc.num_free
        assert not set(self.alloc._free) & (set(held) | cached)

    def teardown(self):
        for req in self.reqs.values():
            self.pages.release(req)
        self.cache.clear()
        assert self.alloc.num_free == NUM_PAGES and self.cache.num_pages == 0


TestPageAccounting = PageAccounting.TestCase
TestPageAccounting.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, database=None)
