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

`HostTierAccounting` runs the same rules over `HiRadixCache` with a 3-page host
tier, so evictions spill, matches load back and a full host pool drops copies; a
model copier moves the modelled KV between the two pools. After every step it
also checks: host free + used == total, used == the nodes holding a host copy
(each with its own page), the device-resident nodes are closed under parents,
and every copy, on either tier, holds exactly its node's token prefix.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator
from pd_cluster.engine.kv.hiradix_cache import HiRadixCache
from pd_cluster.engine.kv.host_tier import HostTier
from pd_cluster.engine.kv.prefix_cache import PrefixCache
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.scheduler.page_manager import PageManager

NUM_PAGES = 12
PAGE_SIZE = 2
PARAMS = SamplingParams(max_tokens=64)
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a tiny vocabulary: prefixes collide often


class ModelCopier:
    """Moves the modelled KV of whole pages between the device model and the host model."""

    def __init__(self, kv: dict, host_kv: dict) -> None:
        self.kv, self.host_kv = kv, host_kv

    def backup(self, pairs):
        for dev, host in pairs:
            self.host_kv[host] = dict(self.kv[dev])

    def load_back(self, pairs):
        for host, dev in pairs:
            self.kv[dev] = dict(self.host_kv[host])


class PageAccounting(RuleBasedStateMachine):
    live = Bundle("live")
    HOST_PAGES = 0  # no host tier

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}  # page -> offset -> modelled KV (the token prefix)
        self.host_kv: dict[int, dict[int, tuple[int, ...]]] = {}  # the same for host pages
        if self.HOST_PAGES:
            self.host = HostTier(self.HOST_PAGES, PAGE_SIZE, ModelCopier(self.kv, self.host_kv))
            self.cache = HiRadixCache(self.alloc, PAGE_SIZE, self.host)
        else:
            self.cache = PrefixCache(self.alloc, PAGE_SIZE)
        self.pages = PageManager(self.alloc, PAGE_SIZE, self.cache)
        self.loaded_matches = 0  # matches that loaded pages back from the host tier
        self.finished_prompts: list[list[int]] = []
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
        before = {p for r in self.reqs.values() if r is not req for p in self._refs(r)}
        cached = self.pages.match(req)
        self.loaded_matches += self.pages.host_hit_tokens(req) > 0
        assert not set(req.block_table) & before - set(self.cache._by_page), "a match took a page someone holds"
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

    @precondition(lambda self: self.finished_prompts)
    @rule(target=live, pick=st.integers(0, 10**6), extra=st.lists(st.integers(0, 2), max_size=3))
    def readmit(self, pick, extra):
        """A prompt seen before comes back (a new turn of a conversation): its pages may be on the host by now."""
        tokens = self.finished_prompts[pick % len(self.finished_prompts)]
        return self.admit(tokens + extra, 6)

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
            self.finished_prompts.append(list(req.token_ids))
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
        if self.HOST_PAGES:
            assert self.host.num_free == self.HOST_PAGES and not self.cache.root.children
            self.totals.update(backup=self.host.backup_pages_total, load_back=self.host.load_back_pages_total,
                               dropped=self.host.dropped_pages_total, hits=self.loaded_matches)


class HostTierAccounting(PageAccounting):
    HOST_PAGES = 3
    totals: Counter = Counter()

    @invariant()
    def host_pages_add_up(self):
        host, held = self.host, {p for r in self.reqs.values() for p in self._refs(r)}
        host_pages = []
        stack = [(n, n.tokens) for n in self.cache.root.children.values()]
        while stack:
            node, path = stack.pop()
            assert not node.evicted and node.parent.children[node.tokens] is node
            on_device, on_host = node.page != NULL_PAGE, node.host_page != 0
            assert on_device or on_host, "a node with no copy anywhere"
            if not on_device:  # device-resident nodes are closed under parents
                assert all(c.page == NULL_PAGE for c in node.children.values())
                assert node.page not in held
            assert node.num_host_children == sum(c.page == NULL_PAGE for c in node.children.values())
            start = len(path) - PAGE_SIZE
            want = {o: tuple(path[:start + o + 1]) for o in range(PAGE_SIZE)}
            if on_device:
                assert self.cache._by_page[node.page] is node and self.kv[node.page] == want, "device copy"
            if on_host:
                host_pages.append(node.host_page)
                assert self.host_kv[node.host_page] == want, "the host copy is not the node's KV"
            stack.extend((c, path + c.tokens) for c in node.children.values())
        assert len(set(host_pages)) == len(host_pages) == host.num_used == self.cache.num_host_pages
        assert host.num_free + host.num_used == self.HOST_PAGES
        assert all(host.allocator.refcount(p) == 1 for p in host_pages)
        assert not set(host.allocator._free) & set(host_pages)


TestPageAccounting = PageAccounting.TestCase
TestPageAccounting.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, database=None)


def test_host_tier_accounting():
    """The host-tier machine; the totals over all examples show spills, loads and host drops happened."""
    HostTierAccounting.totals = Counter()
    run_state_machine_as_test(HostTierAccounting, settings=settings(
        max_examples=200, stateful_step_count=50, deadline=None, database=None, derandomize=True))
    t = HostTierAccounting.totals
    assert t["backup"] > 100 and t["load_back"] > 100 and t["dropped"] > 10 and t["hits"] > 50, t
