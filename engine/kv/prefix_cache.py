"""Prefix cache: full KV pages shared across requests, keyed by their exact token chain.

The structure is SGLang's radix tree (RadixAttention, Zheng et al. 2024) with
every edge exactly one page long: a node is one full page of ``page_size``
tokens, its key is that page's token tuple, and its parent is the page before
it. Matching a prompt walks from the root one page at a time.

Why a page-granular tree and not vLLM's chained page hashes:
- **No collision can serve wrong KV.** A child is found by a dict lookup on the
  exact token tuple, and Python compares keys by equality after hashing, so two
  different token chains never share a node. Chained hashes would need a
  verification of the tokens on every hit (or a cryptographic hash) to say the
  same.
- **Leaf-first LRU eviction** falls out of the tree: only a page whose subtree is
  gone can be evicted, so no cached page is ever left unreachable (a hash map
  keeps such orphans until they age out), and the pages of a long conversation go
  from its tip towards the shared system prompt.
- Only full pages are cached, so the radix tree's edge splitting is never
  needed: a page-long edge is the whole node.

Ownership. The cache holds one reference (`PageAllocator.incref`) on every page
of the tree; each request holds one on every page of its block table. A cached
page with no request reference (reference count 1) is *evictable*: it counts as
available, and `evict` frees it, least recently used first, when the allocator
runs short. Thus ``free + evictable + in use == total`` at all times.

Invariant (what makes leaf-first eviction always able to free every evictable
page): a request that references a node references all its ancestors. Matching
takes the whole chain from the root; a request only adds pages under a node it
holds. When a request computed a page that another request cached first (both
were prefilling the same prefix), it keeps its own copy in its block table and
takes an extra reference on the cached one (an *anchor*) so that its later pages
can hang under it; anchors are released with the request.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator

if TYPE_CHECKING:
    from pd_cluster.engine.kv.host_tier import HostTier


class _Node:
    """One cached page: `tokens` (its ``page_size`` token ids) and `page` (its device page id).

    With a host tier (`pd_cluster.engine.kv.hiradix_cache`) a node may also hold a copy in
    host memory (`host_page`, 0 for none) or only there (`page` == NULL_PAGE);
    `num_host_children` counts children that are on the host only. Without one both stay 0.
    """

    __slots__ = ("tokens", "page", "parent", "children", "stamp", "evicted", "host_page", "num_host_children")

    def __init__(self, tokens: tuple[int, ...], page: int, parent: "_Node | None") -> None:
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.stamp = 0  # logical time of the last use (LRU order)
        self.evicted = False
        self.host_page = 0
        self.num_host_children = 0


@dataclass
class CacheChain:
    """Where one request stands in the tree.

    Attributes:
        node: the deepest node the request holds (the root before anything).
        num_pages: how many leading pages of the request's block table are in the tree
            (matched or inserted); `PrefixCache.insert` continues from here.
        anchors: cached pages the request references without using (see the module docstring).
        num_loaded: how many of the matched pages were loaded back from the host tier.
        num_stored: how many were read from the cluster-wide KV store (`load_pages`).
    """

    node: _Node
    num_pages: int = 0
    anchors: list[int] = field(default_factory=list)
    num_loaded: int = 0
    num_stored: int = 0


class PrefixCache:
    """The page-granular radix tree over one pool's allocator.

    Args:
        allocator: the pool's page allocator (the cache holds one reference per cached page).
        page_size: tokens per page.
        observer: told of pages stored (``stored(parent page or None, pages, token tuples)``) and removed
            (``removed(pages)``), e.g. `pd_cluster.engine.kv.events.KVEventLog`; None: nobody.

    Attributes:
        host: the host-memory tier evicted pages spill to (`HiRadixCache`); None here: they are dropped.
    """

    host: HostTier | None = None

    def __init__(self, allocator: PageAllocator, page_size: int, observer=None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.observer = observer
        self.root = _Node((), NULL_PAGE, None)
        self._by_page: dict[int, _Node] = {}
        self._num_evictable = 0
        self.num_evicted_total = 0
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._lru: list[tuple[int, int, _Node]] = []  # (stamp, seq, node) of evictable leaves; stale entries skipped

    # ---- sizes -------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages in the tree (referenced by requests or not)."""
        return len(self._by_page)

    @property
    def num_evictable(self) -> int:
        """Cached pages no request references: available to `evict`."""
        return self._num_evictable

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    # ---- lookup ------------------------------------------------------------------
    def _keys(self, token_ids: Sequence[int], start: int, stop: int):
        ps = self.page_size
        for i in range(start, stop):
            yield tuple(token_ids[i * ps:(i + 1) * ps])

    def match(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], CacheChain]:
        """Take the longest cached chain of full pages that is a prefix of ``token_ids[:max_tokens]``.

        The pages get one reference each (the caller's); release them with `release`.

        Returns:
            (page ids in order, the chain to continue inserting from).
        """
        node, pages = self.root, []
        for key in self._keys(token_ids, 0, max(max_tokens, 0) // self.page_size):
            child = node.children.get(key)
            if child is None or child.page == NULL_PAGE:  # absent, or on the host only
                break
            node = child
            pages.append(child.page)
        stamp = next(self._clock)
        for p in pages:
            self._acquire(p)
            self._by_page[p].stamp = stamp
        return pages, CacheChain(node, len(pages))

    def load_pages(self, chain: CacheChain, token_ids: Sequence[int], payloads: Sequence, copy_in) -> list[int]:
        """Cache pages read from the cluster-wide KV store right below `chain` (a request's matched prefix, which
        they continue) and hand them to the request as hits (`pd_cluster.engine.kv.l3.tier`).

        As many pages as free plus evictable device pages allow are taken (evicting others), and fewer when the
        tree already has a node for one of them (a host-only copy, which `match` could not load). Each gets
        the cache's reference and the caller's; ``copy_in(pages, payloads)`` writes their bytes.

        Returns:
            The new device pages, in order (``chain`` advanced past them, ``chain.num_stored`` their count).
        """
        first = chain.num_pages
        keys = list(self._keys(token_ids, first, first + len(payloads)))
        if not keys or keys[0] in chain.node.children:  # a new node has no children: only the first can clash
            return []
        short = len(keys) - self.allocator.num_free
        if short > 0:
            self.evict(short)  # the chain's pages are the request's: never evicted here
        keys = keys[:self.allocator.num_free]
        if not keys:
            return []
        pages = self.allocator.allocate(len(keys))  # the cache's reference
        copy_in(pages, payloads[:len(pages)])
        self.allocator.incref(pages)  # the request's reference
        parent, node, stamp = chain.node, chain.node, next(self._clock)
        for key, page in zip(keys, pages):
            child = _Node(key, page, node)
            child.stamp = stamp
            node.children[key] = child
            self._by_page[page] = child
            node = child
        chain.node, chain.num_pages, chain.num_stored = node, first + len(pages), len(pages)
        if self.observer is not None:
            self.observer.stored(None if parent is self.root else parent.page, pages, keys)
        return pages

    def walk(self, token_ids: Sequence[int], max_tokens: int) -> list[_Node]:
        """The nodes of the longest cached chain of full pages that is a prefix of ``token_ids[:max_tokens]``,
        nodes without a device page included; takes no reference (see `acquire`)."""
        node, path = self.root, []
        for key in self._keys(token_ids, 0, max(max_tokens, 0) // self.page_size):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def acquire(self, nodes: Sequence[_Node]) -> None:
        """Take one reference (the caller's) on each node's device page and mark them used now."""
        stamp = next(self._clock)
        for node in nodes:
            self._acquire(node.page)
            node.stamp = stamp

    def oldest_evictable_stamp(self) -> int | None:
        """The last-use stamp of the page `evict` would free first, None when none is evictable (stale heap
        entries are dropped on the way)."""
        while self._lru and not self._is_evictable_leaf(self._lru[0][2], self._lru[0][0]):
            heapq.heappop(self._lru)
        return self._lru[0][0] if self._lru else None

    def insert(self, token_ids: Sequence[int], block_table: Sequence[int], num_full_pages: int,
               chain: CacheChain) -> None:
        """Add the request's pages ``[chain.num_pages, num_full_pages)`` to the tree.

        Args:
            token_ids: the request's tokens (at least ``num_full_pages * page_size``).
            block_table: its page ids; the pages given must hold computed KV for those tokens. A null entry (a
                windowed group's page behind the window that the request never held) adds a hollow node.
            num_full_pages: how many leading pages are full and computed.
            chain: the request's position, advanced in place.
        """
        if num_full_pages <= chain.num_pages:
            return
        node, stamp = chain.node, next(self._clock)
        new: list[_Node] = []  # a chain: a new node has no children, so every later node is new too
        hollow = False
        for i, key in enumerate(self._keys(token_ids, chain.num_pages, num_full_pages), start=chain.num_pages):
            child = node.children.get(key)
            page = block_table[i]
            if page == NULL_PAGE:  # a windowed group's page the request never held (PD decode): tokens only
                if child is None:
                    child = _Node(key, NULL_PAGE, node)
                    node.children[key] = child
                    hollow = True
                node = child  # not stamped: a page there is not this request's, its place in the LRU order stays
                continue
            if child is None:
                child = _Node(key, page, node)
                node.children[key] = child
                self._by_page[page] = child
                self.allocator.incref([page])  # the cache's reference
                new.append(child)
            elif child.page == NULL_PAGE:  # on the host only: the request's page becomes its device copy
                self._adopt(child, page)
                new.append(child)  # host-only nodes have host-only children: `new` stays one chain
            elif child.page != page:  # someone cached this page first: hold theirs as an anchor
                self._acquire(child.page)
                chain.anchors.append(child.page)
            child.stamp = stamp
            node = child
        chain.node, chain.num_pages = node, num_full_pages
        if new and self.observer is not None and not hollow:  # events never name a page behind a hollow node
            parent = new[0].parent
            self.observer.stored(None if parent is self.root else parent.page, [n.page for n in new],
                                 [n.tokens for n in new])

    # ---- references ----------------------------------------------------------------
    def _acquire(self, page: int) -> None:
        if self.allocator.refcount(page) == 1:
            self._num_evictable -= 1
        self.allocator.incref([page])

    def release(self, pages: Sequence[int]) -> None:
        """Drop one request reference from each page; cached pages left unreferenced become evictable."""
        stamp = next(self._clock)
        for p in pages:
            self.allocator.free([p])
            node = self._by_page.get(p)
            if node is not None:
                node.stamp = stamp
                if self.allocator.refcount(p) == 1:
                    self._num_evictable += 1
                    self._push_if_leaf(node)

    def _adopt(self, node: _Node, page: int) -> None:
        """Make `page` (computed KV of `node`'s tokens) the device copy of a node that has none."""
        node.page = page
        self._by_page[page] = node
        self.allocator.incref([page])  # the cache's reference

    @staticmethod
    def _is_device_leaf(node: _Node) -> bool:
        """No child has a device page (children on the host only do not count)."""
        return len(node.children) == node.num_host_children

    def _push_if_leaf(self, node: _Node) -> None:
        if self._is_device_leaf(node) and node is not self.root:
            heapq.heappush(self._lru, (node.stamp, next(self._seq), node))
            if len(self._lru) > 2 * len(self._by_page) + 64:
                self._compact()

    # ---- eviction --------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` evictable pages, least recently used leaves first.

        Returns:
            The number of pages freed (fewer only when fewer were evictable).
        """
        freed, removed = 0, []
        while freed < num_pages and self._lru:
            stamp, _, node = heapq.heappop(self._lru)
            if not self._is_evictable_leaf(node, stamp):
                continue  # stale entry: touched, referenced or grown since it was pushed
            removed.append(node.page)  # it leaves the device (removed, or spilled to a host tier)
            self._evict_node(node)
            freed += 1
            parent = node.parent
            if parent is not self.root and self.allocator.refcount(parent.page) == 1:
                self._push_if_leaf(parent)
        if removed and self.observer is not None:
            self.observer.removed(removed)
        return freed

    def _is_evictable_leaf(self, node: _Node, stamp: int) -> bool:
        return (not node.evicted and node.page != NULL_PAGE and self._is_device_leaf(node)
                and node.stamp == stamp and self.allocator.refcount(node.page) == 1)

    def _evict_node(self, node: _Node) -> None:
        """Free an evictable device leaf's page (the host tier overrides this to spill it)."""
        self._remove(node)

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.tokens]
        del self._by_page[node.page]
        node.evicted = True
        self._num_evictable -= 1
        self.num_evicted_total += 1
        self.allocator.free([node.page])

    def _compact(self) -> None:
        self._lru = [e for e in self._lru if self._is_evictable_leaf(e[2], e[0])]
        heapq.heapify(self._lru)

    def clear(self) -> int:
        """Evict every evictable page (e.g. before a weight update); returns how many were freed."""
        return self.evict(self._num_evictable)
