"""Pages for requests when the model's layers form several KV cache groups, or window layers free pages.

`GroupedPageManager` is the `PageManager` of a hybrid pool (`pd_cluster.engine.kv.groups`): a request holds one
block table per group (``req.block_table`` is group 0's, ``req.group_tables`` the others'), all drawn from one
`PageAllocator`; a state group's table (`KVGroup.is_state`) holds its fixed number of pages from the request's
first step on. Before each step, `trim` frees the pages a windowed group will never read again (those wholly
before the first key the next query sees) and puts the null page in their place, as vLLM's
``SlidingWindowManager.remove_skipped_blocks`` does; the freed pages count as available for that very step. The
device block table is append-only: an entry replaced by the null page keeps its old id there, which no kernel
reads (every attention path starts at the first visible position, `LayerAttention.first_visible`).

In the decode role a request's prompt KV arrives from a prefill worker: `reserve_remote` holds only the pages its
decode reads (a windowed group's window at its first query), and the cache adds the pages behind the window that
it never held as hollow nodes (`WindowPrefixCache`), so later hits can pass through them.

Admission (`pool_tokens`) counts what a request will hold at most in each group: every page for a full group,
``window - 1 + chunk`` tokens (plus the page it straddles) for a windowed one, so a long prompt on a
window-only model needs a window's pages, not the prompt's.
"""

from __future__ import annotations

import math

from pd_cluster.engine.kv.allocator import NULL_PAGE, PageAllocator
from pd_cluster.engine.kv.group_cache import GroupedPrefixCache
from pd_cluster.engine.kv.groups import KVGroups
from pd_cluster.engine.kv.prefix_cache import CacheChain
from pd_cluster.engine.request import Request
from pd_cluster.engine.scheduler.page_manager import PageManager


class GroupedPageManager(PageManager):
    """A `PageManager` over KV cache groups.

    Args:
        allocator: the pool's page allocator (shared by every group).
        page_size: tokens per page.
        groups: the pool's groups.
        chunk: the most tokens one step computes for a request (``--chunked-prefill-size``): a windowed group's
            pages for admission (`pool_tokens`).
        cache: the per-group prefix cache (`GroupedPrefixCache`), None for none.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, groups: KVGroups, chunk: int,
                 cache: GroupedPrefixCache | None = None) -> None:
        super().__init__(allocator, page_size, None)
        self.cache = cache  # type: ignore[assignment]  # the base reads num_evictable, evict and host from it
        self.grouped = True
        self._group_chains: dict[str, list[CacheChain]] = {}  # request id -> its place in each group's tree
        self.groups = groups
        self.chunk = chunk
        self.num_trimmed_total = 0  # pages freed behind a window

    # ---- tables -----------------------------------------------------------------------
    def tables(self, req: Request) -> list[list[int]]:
        """`req`'s block table of every group, group 0 first (created empty on first use)."""
        extra = self.groups.num_groups - 1
        if len(req.group_tables) != extra:
            req.group_tables = [[] for _ in range(extra)]
        return [req.block_table, *req.group_tables]

    def held_pages(self, req: Request) -> list[int]:
        """Pages `req` holds in each group (null entries behind a window not counted)."""
        return [sum(1 for p in t if p != NULL_PAGE) for t in self.tables(req)]

    # ---- growth -----------------------------------------------------------------------
    def trim(self, req: Request) -> int:
        """Free the pages of windowed groups that no query from ``req.num_computed_tokens`` on reads; returns how
        many were freed."""
        freed = 0
        start = req.num_computed_tokens
        chains = self._group_chains.get(req.request_id)
        for g, (group, table) in enumerate(zip(self.groups.groups, self.tables(req))):
            if not group.is_windowed:
                continue
            stop = min(group.first_needed_page(start, self.page_size), len(table))
            if self.cache is not None:  # a page leaves the request only once it is in the cache (insert reads it)
                stop = min(stop, chains[g].num_pages if chains is not None else 0)
            dead = [p for p in table[:stop] if p != NULL_PAGE]
            if dead:
                self._drop(g, dead)
                table[:stop] = [NULL_PAGE] * stop
                freed += len(dead)
        self.num_trimmed_total += freed
        return freed

    def _needs(self, num_tokens: int) -> list[int]:
        """Per group, the table entries a request of `num_tokens` tokens holds (a state group: its fixed count)."""
        return [g.table_pages(num_tokens, self.page_size) for g in self.groups.groups]

    def extra_pages(self, req: Request, num_tokens: int) -> int:
        return sum(max(need - len(t), 0) for need, t in zip(self._needs(num_tokens), self.tables(req)))

    def grow(self, req: Request, num_tokens: int) -> list[int]:
        """Append pages to every group's table so that each covers `num_tokens` tokens (a windowed group's
        entries behind its window are the null page).

        Returns:
            The new page ids, group after group.

        Raises:
            OutOfPagesError: not enough free pages (no table changes).
        """
        needs, tables = self._needs(num_tokens), self.tables(req)
        n = sum(max(need - len(t), 0) for need, t in zip(needs, tables))
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        new = self.allocator.allocate(n)
        i = 0
        for need, t in zip(needs, tables):
            n = max(need - len(t), 0)
            t.extend(new[i:i + n])
            i += n
        return new

    def _remote_firsts(self, req: Request) -> list[int]:
        """Per group, the first page the decode of `req` reads: its first query is at ``req.num_tokens``."""
        return list(self.groups.decode_first_pages(req.num_tokens, self.page_size))

    def _remote_new_pages(self, req: Request, firsts: list[int]) -> int:
        needs = self._needs(req.num_tokens)
        return sum(max(need - max(len(t), first), 0) for need, t, first in zip(needs, self.tables(req), firsts))

    def can_reserve_remote(self, req: Request) -> bool:
        return self._remote_new_pages(req, self._remote_firsts(req)) <= self.num_available

    def reserve_remote(self, req: Request) -> None:
        """Decode role: hold, in every group, the pages of `req`'s known tokens that its decode will read: every
        page for a full group, only those from the window of its first query (at ``req.num_tokens``) on for a
        windowed one, whose earlier entries are the null page (a matched page there is given back), and the state
        group's pages. The prompt's KV (and the state at its end) arrives in them (`KVGroups.transfer_first_pages`
        says which pages the transfer fills).

        Raises:
            OutOfPagesError: not enough free and evictable pages (no table changes).
        """
        firsts = self._remote_firsts(req)
        n = self._remote_new_pages(req, firsts)
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        new = self.allocator.allocate(n)
        i = 0
        for g, (group, table, first, need) in enumerate(zip(self.groups.groups, self.tables(req), firsts,
                                                             self._needs(req.num_tokens))):
            if group.is_windowed:  # matched pages behind the window are never read here: back to the cache
                stop = min(first, len(table))
                dead = [p for p in table[:stop] if p != NULL_PAGE]
                if dead:
                    self._drop(g, dead)
                    table[:stop] = [NULL_PAGE] * stop
            nulls = max(min(first, need) - len(table), 0)
            table.extend([NULL_PAGE] * nulls)
            k = max(need - len(table), 0)
            table.extend(new[i:i + k])
            i += k

    def pool_tokens(self, req: Request, tokens: float) -> float:
        """Pool capacity, in tokens (pages x page size), that `req` still takes to hold ``tokens`` more tokens
        than it has computed: per group, its most pages at that length (`KVGroup.max_pages`) less the pages it
        holds."""
        total = req.num_computed_tokens + math.ceil(tokens)
        pages = 0
        for group, held in zip(self.groups.groups, self.held_pages(req)):
            pages += max(group.max_pages(total, self.chunk, self.page_size) - held, 0)
        return pages * self.page_size

    # ---- prefix cache ---------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """Start `req` (holding no pages) on its longest hit under the hybrid rule (`GroupedPrefixCache.match`);
        its last known token is never matched. Returns the cached tokens (0 without a cache)."""
        if self.cache is None or req.block_table:
            return 0
        tables, chains = self.cache.match(req.cache_tokens, req.num_tokens - 1)
        req.block_table, req.group_tables = tables[0], tables[1:]
        self._group_chains[req.request_id] = chains
        return chains[0].num_pages * self.page_size

    def cache_computed(self, req: Request, num_tokens: int | None = None) -> None:
        """Add every group's full, computed pages of `req` to that group's tree (see `PageManager`)."""
        if self.cache is None:
            return
        computed = req.num_computed_tokens if num_tokens is None else min(num_tokens, req.num_computed_tokens)
        full = min(computed, len(req.token_ids)) // self.page_size
        chains = self._group_chains.get(req.request_id)
        if chains is None:
            chains = self._group_chains[req.request_id] = [CacheChain(t.root) for t in self.cache.trees]
        for g, (table, chain) in enumerate(zip(self.tables(req), chains)):
            self.cache.insert(g, req.cache_tokens, table, full, chain)

    # ---- release ------------------------------------------------------------------------
    def _drop(self, group: int, pages: list[int]) -> None:
        """Drop the request's reference on `pages` of `group` (cached ones stay in the cache)."""
        if self.cache is not None:
            self.cache.release(group, pages)
        else:
            self.allocator.free(pages)

    def release(self, req: Request) -> None:
        """Drop `req`'s references in every group (and its anchors) and empty its tables."""
        chains = self._group_chains.pop(req.request_id, None)
        for g, t in enumerate(self.tables(req)):
            live = [p for p in t if p != NULL_PAGE] + (chains[g].anchors if chains else [])
            if live:
                self._drop(g, live)
            if chains is not None and self.groups.groups[g].is_windowed:
                self.cache.trees[g].prune_hollow(chains[g].node)
        req.block_table = []
        req.group_tables = []
