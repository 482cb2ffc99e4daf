"""The prefix cache of a hybrid pool: one page-granular radix tree per KV group, over the one shared allocator.

A hit of ``L`` tokens (a multiple of the page size) needs, in every full group, the pages of all ``L`` tokens,
and in a windowed group only the pages that the query at position ``L`` reads (from
`KVGroup.first_visible` of ``L`` on): vLLM's hybrid rule (``HybridKVCacheCoordinator.find_longest_cache_hit``;
each group's manager says what a hit needs). The request takes references on those pages only; the entries of
its windowed tables before them are the null page.

Each group's tree is a `PrefixCache` (exact token keys). A full group's tree evicts leaf first, as always. A
windowed group's tree (`WindowPrefixCache`) evicts any unreferenced page, least recently used first: an inner
node whose page goes stays in the tree *hollow* (its tokens, no page), so a later hit can still pass through it
as long as the pages its window needs are there. Eviction takes the least recently used evictable page over
all groups (the trees share one logical clock). KV events (`pd_cluster.engine.kv.events`) come from group 0's
tree, a full group whenever the model has one: the router's view of a prefix is the full layers' view; a hit can
come out shorter than the events promise when a windowed group's last pages were evicted first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator
from pd_cluster.engine.kv.groups import KVGroups
from pd_cluster.engine.kv.prefix_cache import CacheChain, PrefixCache, _Node


class GroupedPrefixCache:
    """One `PrefixCache` per KV group.

    Args:
        allocator: the pool's page allocator (shared by every group).
        page_size: tokens per page.
        groups: the pool's groups.
        observer: KV event observer of group 0's tree (`PrefixCache.observer`), or None.
    """

    host = None  # no host tier for a hybrid pool

    def __init__(self, allocator: PageAllocator, page_size: int, groups: KVGroups, observer=None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.groups = groups
        clock = itertools.count(1)
        self.trees = [(WindowPrefixCache if group.is_windowed else PrefixCache)(
            allocator, page_size, observer if g == 0 else None) for g, group in enumerate(groups.groups)]
        for tree in self.trees:
            tree._clock = clock  # one logical time: stamps compare across trees for eviction

    @property
    def num_evictable(self) -> int:
        return sum(t.num_evictable for t in self.trees)

    @property
    def num_pages(self) -> int:
        return sum(t.num_pages for t in self.trees)

    @property
    def num_evicted_total(self) -> int:
        return sum(t.num_evicted_total for t in self.trees)

    # ---- lookup ------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[list[int]], list[CacheChain]]:
        """The longest hit under the hybrid rule (module docstring) within ``token_ids[:max_tokens]``.

        Returns:
            (each group's block table for the hit: page ids, the null page before a windowed group's window;
            each group's chain to continue inserting from). The pages hold one reference each (the caller's).
        """
        ps = self.page_size
        paths = [tree.walk(token_ids, max_tokens) for tree in self.trees]  # nodes, hollow ones included
        hit = min(_device_prefix(path) if not g.is_windowed else len(path)
                  for g, path in zip(self.groups.groups, paths))
        while hit and not all(_holds_window(path, g.first_needed_page(hit * ps, ps), hit)
                              for g, path in zip(self.groups.groups, paths) if g.is_windowed):
            hit -= 1
        tables, chains = [], []
        for group, tree, path in zip(self.groups.groups, self.trees, paths):
            first = group.first_needed_page(hit * ps, ps) if hit else 0
            tree.acquire(path[first:hit])
            tables.append([NULL_PAGE] * first + [n.page for n in path[first:hit]])
            chains.append(CacheChain(path[hit - 1] if hit else tree.root, hit))
        return tables, chains

    def insert(self, group: int, token_ids: Sequence[int], block_table: Sequence[int], num_full_pages: int,
               chain: CacheChain) -> None:
        """`PrefixCache.insert` into `group`'s tree. The pages ``[chain.num_pages, num_full_pages)`` of
        `block_table` must be live, or the null page in a windowed group whose request never held that page (a
        PD decode's, `GroupedPageManager.reserve_remote`): a hollow node (a windowed group frees a page it held
        only once inserted)."""
        self.trees[group].insert(token_ids, block_table, num_full_pages, chain)

    # ---- references ----------------------------------------------------------------------
    def release(self, group: int, pages: Sequence[int]) -> None:
        self.trees[group].release(pages)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` evictable pages, the least recently used leaf of any group first; returns how
        many were freed."""
        freed = 0
        while freed < num_pages:
            oldest = None
            for tree in self.trees:
                stamp = tree.oldest_evictable_stamp()
                if stamp is not None and (oldest is None or stamp < oldest[0]):
                    oldest = (stamp, tree)
            if oldest is None or not oldest[1].evict(1):
                break
            freed += 1
        return freed

    def clear(self) -> int:
        """Evict every evictable page; returns how many were freed."""
        return sum(tree.clear() for tree in self.trees)


def _device_prefix(path: list[_Node]) -> int:
    """How many leading nodes of `path` hold a page."""
    for i, node in enumerate(path):
        if node.page == NULL_PAGE:
            return i
    return len(path)


def _holds_window(path: list[_Node], first: int, hit: int) -> bool:
    return hit <= len(path) and all(node.page != NULL_PAGE for node in path[first:hit])


class WindowPrefixCache(PrefixCache):
    """A windowed group's tree: any unreferenced page is evictable, least recently used first (module
    docstring). An evicted leaf leaves the tree (and so do hollow ancestors it leaves childless); an evicted inner
    node stays, hollow (``page`` the null page), until its subtree is gone or a request computes its page again
    (`PrefixCache.insert` adopts it)."""

    def _push_if_leaf(self, node: _Node) -> None:
        if node is not self.root:
            heapq.heappush(self._lru, (node.stamp, next(self._seq), node))
            if len(self._lru) > 2 * len(self._by_page) + 64:
                self._compact()

    def _is_evictable_leaf(self, node: _Node, stamp: int) -> bool:
        return (not node.evicted and node.page != NULL_PAGE and node.stamp == stamp
                and self.allocator.refcount(node.page) == 1)

    def insert(self, token_ids: Sequence[int], block_table: Sequence[int], num_full_pages: int,
               chain: CacheChain) -> None:
        """`PrefixCache.insert`, after putting back the request's path when its chain's node left the tree
        meanwhile (a hollow or given-back node evicted or pruned while the request ran): the tokens' nodes from
        the root, hollow where missing, so what the request inserts stays reachable."""
        if chain.node is not self.root and chain.node.evicted:
            node = self.root
            for key in self._keys(token_ids, 0, chain.num_pages):
                child = node.children.get(key)
                if child is None:
                    child = _Node(key, NULL_PAGE, node)
                    node.children[key] = child
                node = child
            chain.node = node
        super().insert(token_ids, block_table, num_full_pages, chain)

    def prune_hollow(self, node: _Node) -> None:
        """Remove `node` and its ancestors while they are hollow and childless (a request that inserted hollow
        nodes ended before a page of its own followed them), so nodes without pages do not pile up. Another
        request standing on that chain puts the path back at its next insert (`insert`)."""
        while node is not self.root and node.page == NULL_PAGE and not node.children and not node.evicted:
            del node.parent.children[node.tokens]
            node.evicted = True
            node = node.parent

    def _evict_node(self, node: _Node) -> None:
        if node.children:  # hollow: the tokens stay, the page goes
            del self._by_page[node.page]
            self.allocator.free([node.page])
            node.page = NULL_PAGE
            self._num_evictable -= 1
            self.num_evicted_total += 1
            return
        self._remove(node)
        parent = node.parent
        # an evicted (pruned) hollow node is already out of the tree: a request that stood on it when it was
        # pruned inserted its own pages below it, and their eviction stops there
        while parent is not self.root and not parent.evicted and parent.page == NULL_PAGE and not parent.children:
            del parent.parent.children[parent.tokens]  # a hollow node left childless: nothing to reach
            parent.evicted = True
            parent = parent.parent
