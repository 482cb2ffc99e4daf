"""A windowed group's tree with hollow nodes a PD decode inserted (pages behind the window it never held): a
request's chain that ends hollow is pruned when it ends, and a second request that stood on that chain keeps
working: its next insert puts the path back, its pages are evicted and freed, and the tree never breaks."""

from __future__ import annotations

from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator
from pd_cluster.engine.kv.group_cache import WindowPrefixCache
from pd_cluster.engine.kv.prefix_cache import CacheChain

PS = 4


def test_a_pruned_hollow_chain_under_another_request_still_evicts_cleanly():
    alloc = PageAllocator(8)
    tree = WindowPrefixCache(alloc, PS)
    tokens = list(range(1, 13))  # 3 full pages
    a = CacheChain(tree.root)
    tree.insert(tokens, [NULL_PAGE] * 3, 3, a)  # request A: every page behind its window: 3 hollow nodes
    assert a.node.page == NULL_PAGE and tree.num_pages == 0
    path = tree.walk(tokens + [13], 13)
    assert len(path) == 3  # a hit can pass through hollow nodes
    b = CacheChain(path[-1], 3)  # request B stands on A's hollow chain
    tree.prune_hollow(a.node)  # A ends: its hollow chain goes (nothing else in the tree hangs below it)
    assert tree.walk(tokens, 12) == []
    page = alloc.allocate(1)[0]
    tree.insert(tokens + [13, 14, 15, 16], [NULL_PAGE] * 3 + [page], 4, b)  # B's own page: the path comes back
    assert [n.page for n in tree.walk(tokens + [13, 14, 15, 16, 17], 17)] == [NULL_PAGE] * 3 + [page]
    tree.release([page])  # B ends: its page is only the cache's now
    assert tree.num_evictable == 1 and alloc.num_free == 7
    assert tree.evict(1) == 1  # the page goes, and the hollow path with it
    assert alloc.num_free == 8 and tree.num_pages == 0 and tree.num_evictable == 0 and not tree.root.children


def test_a_node_pruned_earlier_stops_the_eviction_walk():
    """A subtree hanging below a node already out of the tree (the state a chain that stood on a pruned node left
    before insert put paths back) is still evicted without touching the tree."""
    alloc = PageAllocator(4)
    tree = WindowPrefixCache(alloc, PS)
    chain = CacheChain(tree.root)
    tree.insert(list(range(1, 9)), [NULL_PAGE] * 2, 2, chain)
    detached = chain.node
    tree.prune_hollow(detached)
    assert detached.evicted and not tree.root.children
    page = alloc.allocate(1)[0]
    leaf = type(detached)((9, 10, 11, 12), page, detached)  # inserted below it by hand
    detached.children[leaf.tokens] = leaf
    tree._by_page[page] = leaf
    alloc.incref([page])
    tree.release([page])
    assert tree.evict(1) == 1 and alloc.num_free == 4


def test_a_chain_ending_in_a_page_keeps_its_hollow_path():
    alloc = PageAllocator(8)
    tree = WindowPrefixCache(alloc, PS)
    page = alloc.allocate(1)[0]
    chain = CacheChain(tree.root)
    tree.insert(list(range(1, 17)), [NULL_PAGE] * 3 + [page], 4, chain)
    tree.prune_hollow(chain.node)  # a node with a page: nothing to prune
    assert [n.page for n in tree.walk(list(range(1, 18)), 17)] == [NULL_PAGE] * 3 + [page]
    tree.release([page])
    assert tree.evict(1) == 1 and tree.walk(list(range(1, 18)), 17) == []  # the hollow path goes with its leaf
    assert alloc.num_free == 8
