"""The page-granular radix tree: full pages only, exact-token keys, shared references, leaf-first LRU."""

from __future__ import annotations

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.prefix_cache import CacheChain, PrefixCache


def cached_request(cache: PrefixCache, tokens: list[int]) -> tuple[list[int], CacheChain]:
    """A request that matched `tokens`, computed the rest, and cached its full pages."""
    pages, chain = cache.match(tokens, len(tokens) - 1)
    n = -(-len(tokens) // cache.page_size)
    table = pages + cache.allocator.allocate(n - len(pages))
    cache.insert(tokens, table, len(tokens) // cache.page_size, chain)
    return table, chain


def test_only_full_pages_are_cached_and_the_last_token_is_never_matched():
    alloc = PageAllocator(10)
    cache = PrefixCache(alloc, 4)
    table, chain = cached_request(cache, list(range(10)))  # 2 full pages + 2 tokens
    assert cache.num_pages == 2 and [cache.is_cached(p) for p in table] == [True, True, False]
    cache.release(table + chain.anchors)
    assert cache.num_evictable == 2 and alloc.num_free == 8
    assert cache.match(list(range(8)), 7)[0] == table[:1]  # 8 tokens: the 2nd page holds the last one
    assert cache.match(list(range(9)), 8)[0] == table[:2]
    assert cache.match([0, 1, 2, 9, 4, 5, 6, 7, 8], 8)[0] == []  # one token differs in the first page


def test_equal_hashes_never_share_a_node():
    assert hash((-1,)) == hash((-2,))  # CPython: hash(-1) == hash(-2), so these keys collide
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, 1)
    table, chain = cached_request(cache, [-1, 5, 6])
    cache.release(table + chain.anchors)
    assert cache.match([-2, 5, 6], 2)[0] == []  # a hash map keyed by hashes alone would serve [-1]'s KV
    assert cache.match([-1, 5, 6], 2)[0] == table[:2]


def test_references_keep_pages_and_lru_evicts_cold_leaves_first():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, 2)
    a, ca = cached_request(cache, [1, 1, 2, 2, 3, 3, 0])  # 3 pages cached
    b, cb = cached_request(cache, [1, 1, 9, 9, 0])        # shares a's first page; 1 new page cached
    assert b[0] == a[0] and alloc.refcount(a[0]) == 3    # the cache and both requests
    cache.release(a + ca.anchors)
    cache.release(b + cb.anchors)
    assert cache.num_evictable == 4 and alloc.num_free == 4
    again, chain = cache.match([1, 1, 2, 2, 3, 3, 7], 6)  # a's chain is used again: b's page is now the coldest
    cache.release(again)
    assert cache.evict(1) == 1 and not cache.is_cached(b[1])
    assert cache.evict(1) == 1 and not cache.is_cached(a[2])  # a leaf; the shared head page goes last
    assert cache.evict(10) == 2 and cache.num_pages == 0 and alloc.num_free == 8


def test_a_page_cached_by_another_request_is_held_as_an_anchor():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, 2)
    tokens = [4, 4, 5, 5, 6]
    # Both requests computed the same 2 pages before either cached them.
    first, second = alloc.allocate(3), alloc.allocate(3)
    c1, c2 = CacheChain(cache.root), CacheChain(cache.root)
    cache.insert(tokens, first, 2, c1)
    cache.insert(tokens, second, 2, c2)
    assert c2.anchors == first[:2] and all(not cache.is_cached(p) for p in second)
    second += alloc.allocate(1)
    cache.insert(tokens + [8, 8], second, 3, c2)  # its next page hangs under the anchor
    cache.release(first + c1.anchors)
    assert cache.num_evictable == 0  # still held by the second request, through its anchors
    assert cache.evict(8) == 0
    cache.release(second + c2.anchors)
    assert cache.num_evictable == 3 and cache.evict(8) == 3 and alloc.num_free == 8
