"""Grows and frees a request's block table on top of the page allocator and the prefix cache.

A small manager in mini-sglang's style: the scheduler asks it whether a
request's next tokens fit and to make room; it never decides who runs. With a
`PrefixCache` it also starts a request on its cached prefix (`match`), adds the
pages a step completed to the cache (`cache_computed`), and evicts unreferenced
cached pages, least recently used first, before reporting that pages are short.
"""

from __future__ import annotations

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.prefix_cache import CacheChain, PrefixCache
from pd_cluster.engine.request import Request


class PageManager:
    """Pages for requests, taken on demand as sequences grow.

    Args:
        allocator: the pool's page allocator.
        page_size: tokens per page.
        cache: the prefix cache over `allocator`; None disables prefix caching.

    Page states: *free* (in the allocator), *evictable* (cached, no request
    holds it) and *in use*; ``num_free + num_evictable + num_in_use == num_pages``.
    """

    grouped = False  # `GroupedPageManager`: several KV groups / window pages freed

    def __init__(self, allocator: PageAllocator, page_size: int, cache: PrefixCache | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.cache = cache
        self.l3 = None  # the cluster-wide KV store's tier (`pd_cluster.engine.kv.l3.tier.L3Tier`), set by the engine
        self._chains: dict[str, CacheChain] = {}  # request id -> its place in the cache

    # ---- sizes ---------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return self.cache.num_evictable if self.cache is not None else 0

    @property
    def num_available(self) -> int:
        """Pages a request could get now: free plus evictable."""
        return self.allocator.num_free + self.num_evictable

    @property
    def num_in_use(self) -> int:
        return self.allocator.num_pages - self.num_available

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def extra_pages(self, req: Request, num_tokens: int) -> int:
        """Pages `req` lacks to hold its first `num_tokens` tokens."""
        return max(self.pages_for(num_tokens) - len(req.block_table), 0)

    def trim(self, req: Request) -> int:
        """Free pages no later query of `req` reads (none here: every page stays); returns how many."""
        return 0

    def tables(self, req: Request) -> list[list[int]]:
        """`req`'s block table of every KV group, group 0 first (here: its one block table)."""
        return [req.block_table]

    def can_reserve_remote(self, req: Request) -> bool:
        """Decode role: whether `reserve_remote` can hold `req`'s every known token now."""
        return self.can_grow(req, req.num_tokens)

    def reserve_remote(self, req: Request) -> None:
        """Decode role: hold pages for every known token of `req` (past its matched prefix), for its prompt's
        KV to arrive in. Raises `OutOfPagesError` as `grow`."""
        self.grow(req, req.num_tokens)

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.extra_pages(req, num_tokens) <= self.num_available

    def grow(self, req: Request, num_tokens: int) -> list[int]:
        """Append pages so `req` holds `num_tokens` tokens, evicting cached pages if needed.

        Returns:
            The new page ids.

        Raises:
            OutOfPagesError: not enough free and evictable pages (the block table is unchanged).
        """
        n = self.extra_pages(req, num_tokens)
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        new = self.allocator.allocate(n)
        req.block_table.extend(new)
        return new

    def shrink(self, req: Request, num_tokens: int) -> int:
        """Give back the pages of `req` past its first `num_tokens` tokens (speculative decoding's rejected
        drafts); returns how many. Those pages were never cached (only computed, accepted tokens are)."""
        keep = self.pages_for(num_tokens)
        tail = req.block_table[keep:]
        if not tail:
            return 0
        del req.block_table[keep:]
        if self.cache is not None:
            self.cache.release(tail)
        else:
            self.allocator.free(tail)
        return len(tail)

    # ---- prefix cache -----------------------------------------------------------------
    def match(self, req: Request) -> int:
        """Start `req` (holding no pages) on its longest cached prefix of full pages.

        The last known token is never matched, so at least one token is computed and
        sampled. Returns the number of cached tokens (0 without a cache).
        """
        if self.cache is None or req.block_table:
            return 0
        pages, chain = self.cache.match(req.cache_tokens, req.num_tokens - 1)
        if self.l3 is not None:  # pages read from the store for this request continue the match
            payloads = self.l3.take(req.request_id, len(pages))
            if payloads:
                pages += self.cache.load_pages(chain, req.cache_tokens, payloads, self.l3.copy_in)
        req.block_table = pages
        self._chains[req.request_id] = chain
        return len(pages) * self.page_size

    def host_hit_tokens(self, req: Request) -> int:
        """Tokens of `req`'s last `match` that were loaded back from the host tier (0 without one)."""
        chain = self._chains.get(req.request_id)
        return chain.num_loaded * self.page_size if chain is not None else 0

    def stored_hit_tokens(self, req: Request) -> int:
        """Tokens of `req`'s last `match` read from the cluster-wide KV store (0 without one)."""
        chain = self._chains.get(req.request_id)
        return chain.num_stored * self.page_size if chain is not None else 0

    @property
    def has_host_tier(self) -> bool:
        """A tier beyond the device is on: the host tier or the KV store (vLLM's external prefix cache)."""
        return self.cache is not None and (self.cache.host is not None or self.l3 is not None)

    def cache_computed(self, req: Request, num_tokens: int | None = None) -> None:
        """Add the pages of `req` that are full and computed to the prefix cache.

        Args:
            num_tokens: tokens whose KV is final (default ``req.num_computed_tokens``; overlap scheduling passes
                the end of the completed step, as a later step may still be writing).
        """
        if self.cache is None:
            return
        computed = req.num_computed_tokens if num_tokens is None else min(num_tokens, req.num_computed_tokens)
        chain = self._chains.get(req.request_id)
        if chain is None:
            chain = self._chains[req.request_id] = CacheChain(self.cache.root)
        self.cache.insert(req.cache_tokens, req.block_table, min(computed, len(req.token_ids)) // self.page_size,
                          chain)

    # ---- release -------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """Drop `req`'s references to its pages and empty its block table.

        Uncached pages become free; cached ones stay in the cache (evictable once unreferenced).
        """
        chain = self._chains.pop(req.request_id, None)
        if self.cache is not None:
            self.cache.release(req.block_table + (chain.anchors if chain else []))
        elif req.block_table:
            self.allocator.free(req.block_table)
        req.block_table = []

    @property
    def free_tokens(self) -> int:
        """Tokens the available (free plus evictable) pages hold."""
        return self.num_available * self.page_size

    @property
    def token_usage(self) -> float:
        """Pages in use (evictable cached pages not counted) over all pages, 0..1 (SGLang's ``token usage``)."""
        return self.num_in_use / self.allocator.num_pages
