"""The prefix cache with a host-memory tier: nodes live on the device, on the host, or both.

SGLang's ``HiRadixCache`` (python/sglang/srt/mem_cache/hiradix_cache.py) in this
project's page-granular tree (`pd_cluster.engine.kv.prefix_cache`), with the
write-back policy:

- **Spill.** When eviction picks a device leaf, its page is copied to a host page
  (`HostTier.alloc`, which gives up the least recently used host copy when the host
  pool is full) and the node stays in the tree, on the host only (``page ==
  NULL_PAGE``). A node already on both just drops its device page, without a copy.
  If no host page can be had, the node leaves the tree with its host-only subtree.
- **Load.** `match` continues past the device-resident prefix into host-only nodes,
  takes device pages for them (evicting, hence spilling, other unreferenced pages if
  needed), copies the bytes back and hands the request those pages as an ordinary
  device hit. The node is then on both.
- **Adopt.** A request that computed a page which is cached on the host only (two
  requests prefilling the same prefix) gives the node its page as the device copy;
  the host copy is released so that "both" always means identical bytes.

Invariants (checked by tests/engine/test_prefix_cache_accounting.py):
- the device-resident nodes are closed under parents: eviction takes device leaves
  (``len(children) == num_host_children``) and loads extend a device chain, so every
  child of a host-only node is host-only;
- host pages: free + used == total, and used == nodes holding a host copy; requests
  never reference host pages, so nothing a request holds is touched by the tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pd_cluster.engine.config import CacheConfig
from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator
from pd_cluster.engine.kv.host_tier import HostKVPool, HostTier
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.kv.prefix_cache import CacheChain, PrefixCache, _Node
from pd_cluster.engine.kv.sizing import plan_host_pool

logger = logging.getLogger("engine")


class HiRadixCache(PrefixCache):
    """`PrefixCache` whose evicted pages spill to `host` and load back on a hit.

    Args:
        allocator: the device pool's page allocator.
        page_size: tokens per page.
        host: the host tier (its pool, allocator and LRU).
        observer: as `PrefixCache`'s: a page spilled to the host is reported removed (it left the device),
            and stored again when it loads back.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, host: HostTier, observer=None) -> None:
        super().__init__(allocator, page_size, observer)
        self.host = host
        self._spills: list[tuple[int, int]] = []  # (device page, host page) waiting for one batched copy
        self._loading: set[_Node] = set()         # host-only nodes a match is about to load: never dropped
        self._spilling = True                     # False while `clear` empties the device tree

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def num_host_pages(self) -> int:
        """Nodes holding a host copy (host-only or both)."""
        return self.host.num_used

    # ---- load ----------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], CacheChain]:
        """`PrefixCache.match`, then load the host-only continuation of the match back to the device.

        As many host pages are loaded as free plus evictable device pages allow (the rest of the
        chain stays on the host). ``chain.num_loaded`` says how many of the returned pages came
        from the host.
        """
        pages, chain = super().match(token_ids, max_tokens)
        hosted: list[_Node] = []
        node = chain.node
        for key in self._keys(token_ids, len(pages), max(max_tokens, 0) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            hosted.append(child)  # on the host only: the device part of the chain ended above it
            node = child
        if not hosted:
            return pages, chain
        self._loading.update(hosted)
        try:
            short = len(hosted) - self.allocator.num_free
            if short > 0:
                self.evict(short)
        finally:
            self._loading.difference_update(hosted)
        hosted = hosted[:self.allocator.num_free]
        if not hosted:
            return pages, chain
        device = self.allocator.allocate(len(hosted))  # the cache's reference
        stamp = next(self._clock)
        for n, page in zip(hosted, device):
            n.page = page
            n.stamp = stamp
            self._by_page[page] = n
            n.parent.num_host_children -= 1
        self.allocator.incref(device)  # the request's reference
        self.host.load_back([(n.host_page, page) for n, page in zip(hosted, device)])
        if self.observer is not None:  # back on the device: stored again (spilled pages were reported removed)
            parent = hosted[0].parent
            self.observer.stored(None if parent is self.root else parent.page, device, [n.tokens for n in hosted])
        pages.extend(device)
        chain.node, chain.num_pages, chain.num_loaded = hosted[-1], len(pages), len(hosted)
        return pages, chain

    # ---- spill ---------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """`PrefixCache.evict`; the evicted pages are copied to the host in one batch before returning."""
        freed = super().evict(num_pages)
        if self._spills:
            spills, self._spills = self._spills, []
            self.host.backup(spills)
        return freed

    def _evict_node(self, node: _Node) -> None:
        if node.host_page == 0 and self._spilling:
            host_page = self.host.alloc(self._can_drop_host, self._drop_host)
            if host_page:
                node.host_page = host_page
                self._spills.append((node.page, host_page))
        if node.host_page == 0 or not self._spilling:
            self._drop_host_subtree(node)
            self._remove(node)
            return
        page = node.page
        del self._by_page[page]
        self._num_evictable -= 1
        self.num_evicted_total += 1
        node.page = NULL_PAGE
        node.parent.num_host_children += 1
        self.allocator.free([page])
        self.host.track(node)

    def _adopt(self, node: _Node, page: int) -> None:
        super()._adopt(node, page)
        node.parent.num_host_children -= 1
        if node.host_page:
            self.host.free(node.host_page)
            node.host_page = 0

    # ---- host copies ---------------------------------------------------------------------
    def _can_drop_host(self, node: _Node) -> bool:
        """A copy on both tiers can always lose its host half; a host-only node only as a leaf."""
        return node not in self._loading and (node.page != NULL_PAGE or not node.children)

    def _drop_host(self, node: _Node) -> None:
        self.host.free(node.host_page)
        node.host_page = 0
        if node.page == NULL_PAGE:  # host-only leaf: it leaves the tree
            del node.parent.children[node.tokens]
            node.parent.num_host_children -= 1
            node.evicted = True

    def _drop_host_subtree(self, node: _Node) -> None:
        """Forget `node`'s host copy and its children, which are all on the host only."""
        if node.host_page:
            self.host.free(node.host_page)
            node.host_page = 0
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.host.free(n.host_page)
            n.host_page = 0
            n.evicted = True
        node.children.clear()
        node.num_host_children = 0

    def clear(self) -> int:
        """Evict every evictable device page and forget every host copy; returns the device pages freed."""
        self._spilling = False
        try:
            freed = super().clear()
        finally:
            self._spilling = True
        stack = list(self.root.children.values())
        while stack:  # what is left on the device is held by requests: keep it, drop host halves
            n = stack.pop()
            if n.page == NULL_PAGE:
                del n.parent.children[n.tokens]
                n.parent.num_host_children -= 1
                self._drop_host_subtree(n)
                n.evicted = True
                continue
            if n.host_page:
                self.host.free(n.host_page)
                n.host_page = 0
            stack.extend(n.children.values())
        return freed


def build_prefix_cache(cache: CacheConfig, role: str, allocator: PageAllocator, pool: KVPool,
                       observer=None) -> PrefixCache | None:
    """The prefix cache an engine of `role` keeps: none with ``--disable-radix-cache``; with
    ``--enable-hierarchical-cache`` (prefill and mixed roles) a `HiRadixCache` over a host tier sized by
    `plan_host_pool`; else a device-only `PrefixCache` (the decode role's: pages of finished requests).

    Raises:
        ValueError: the host tier holds no page or exceeds the host memory available.
    """
    if not cache.enable_prefix_caching:
        return None
    if not cache.enable_hierarchical_cache or role == "decode":
        if cache.enable_hierarchical_cache:
            logger.warning("--enable-hierarchical-cache has no effect in the decode role: its prefix cache "
                           "stays on the device")
        return PrefixCache(allocator, pool.page_size, observer)
    plan = plan_host_pool(pool.layout, cache, pool.num_pages)
    host_pool = HostKVPool(pool, plan.num_pages)
    tier = HostTier(plan.num_pages, pool.page_size, host_pool)
    logger.info("Allocating %.2f GB host memory for hierarchical KV cache: %d pages, %d tokens (%s%s, pinned=%s)",
                host_pool.nbytes / 1e9, plan.num_pages, tier.max_total_num_tokens, plan.source,
                f"={cache.hicache_ratio:g}" if plan.source == "hicache_ratio" else "", pool.device.type == "cuda")
    if plan.num_pages <= pool.num_pages:
        logger.warning("HiCache host KV pool (%d tokens) is not larger than the device pool (%d tokens); "
                       "raise --hicache-ratio or --hicache-size for more host hits",
                       tier.max_total_num_tokens, pool.max_total_num_tokens)
    return HiRadixCache(allocator, pool.page_size, tier, observer)
