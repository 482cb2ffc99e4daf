"""An approximate, bounded prefix tree of routed prompts, shared by all workers.

The idea is SGLang router's approximate radix tree for cache-aware routing:
remember which worker recently saw which prompt prefix. Here the tree's edges
are fixed-size character blocks, and a node is identified by the hash of its
path (`common.routing_text.block_hashes`: the text up to the block's end; the
last node is the whole text), so a node lookup is one dict access and a prompt
of ``n`` characters costs ``n / block_chars`` lookups. Hash collisions only
cost routing quality.

Each (node, worker) pair is one entry in one LRU order. Entries of one prompt
are touched deepest first, so eviction takes a chain's tail before its head.
The number of entries is bounded (``max_chars / block_chars``); entries idle
longer than ``idle_secs`` are dropped by :meth:`ApproxPrefixTree.evict_idle`.
Pure Python, no I/O; time comes from an injected clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pd_cluster.common.routing_text import block_hashes


class ApproxPrefixTree:
    """Block-level prefix tree mapping prompt prefixes to workers ("tenants").

    ``block_chars``: edge length in characters. ``max_chars``: bound on
    ``entries * block_chars``. ``max_blocks``: only the first blocks of a very
    long prompt are tracked. ``clock``: monotonic seconds.
    """

    def __init__(self, block_chars: int, max_chars: int, clock: Callable[[], float],
                 max_blocks: int = 4096) -> None:
        if block_chars < 1 or max_chars < block_chars:
            raise ValueError("need 1 <= block_chars <= max_chars")
        self.block_chars = block_chars
        self.max_entries = max_chars // block_chars
        self.max_blocks = max_blocks
        self._clock = clock
        self._nodes: dict[int, set[str]] = {}
        self._lru: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._per_tenant: dict[str, int] = {}

    def __len__(self) -> int:
        """Number of (node, tenant) entries."""
        return len(self._lru)

    def tenant_size(self, tenant: str) -> int:
        """Entries held for one tenant."""
        return self._per_tenant.get(tenant, 0)

    def path_hashes(self, text: str) -> list[int]:
        """Chain hashes of ``text``'s full blocks, then of the whole text (`common.routing_text.block_hashes`, in
        this tree's blocks)."""
        return block_hashes(text, self.block_chars, self.max_blocks)

    def routed_depth(self, hashes: list[int], tenant: str, since: float) -> int:
        """How many leading blocks of ``hashes`` were sent to ``tenant`` at or after time ``since``."""
        lru, depth = self._lru, 0
        for h in hashes:
            stamp = lru.get((h, tenant))
            if stamp is None or stamp < since:
                break
            depth += 1
        return depth

    def match(self, hashes: list[int], tenants: Iterable[str]) -> tuple[set[str], int]:
        """Deepest match among ``tenants``.

        Returns the tenants holding the longest matched prefix and its length in
        blocks; ``(set(), 0)`` when none matches the first block.
        """
        alive = set(tenants)
        nodes = self._nodes
        depth = 0
        for h in hashes:
            node = nodes.get(h)
            if node is None:
                break
            if not alive <= node:  # the set narrows here (a new set: the deeper match's is kept intact)
                narrowed = alive & node
                if not narrowed:
                    break
                alive = narrowed
            depth += 1
        return (alive if depth else set()), depth

    def insert(self, hashes: list[int], tenant: str, now: float | None = None) -> None:
        """Record that ``tenant`` was sent the prompt with these block hashes (at ``now``, else the clock's time)."""
        now = self._clock() if now is None else now
        lru, nodes = self._lru, self._nodes
        added = 0
        for h in reversed(hashes):
            key = (h, tenant)
            if lru.pop(key, None) is None:
                nodes.setdefault(h, set()).add(tenant)
                added += 1
            lru[key] = now  # at the end: most recently used
        if added:
            self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + added
        while len(lru) > self.max_entries:
            self._pop_oldest()

    def evict_idle(self, idle_secs: float) -> int:
        """Drop entries not touched for ``idle_secs``; returns how many."""
        cutoff = self._clock() - idle_secs
        dropped = 0
        while self._lru:
            _, stamp = next(iter(self._lru.items()))
            if stamp > cutoff:
                break
            self._pop_oldest()
            dropped += 1
        return dropped

    def remove_tenant(self, tenant: str) -> None:
        """Forget every entry of ``tenant`` (a worker that left)."""
        for key in [k for k in self._lru if k[1] == tenant]:
            del self._lru[key]
            self._discard(key)
        self._per_tenant.pop(tenant, None)

    def _pop_oldest(self) -> None:
        key, _ = self._lru.popitem(last=False)
        self._discard(key)
        tenant = key[1]
        left = self._per_tenant.get(tenant, 1) - 1
        if left > 0:
            self._per_tenant[tenant] = left
        else:
            self._per_tenant.pop(tenant, None)

    def _discard(self, key: tuple[int, str]) -> None:
        h, tenant = key
        node = self._nodes.get(h)
        if node is None:
            return
        node.discard(tenant)
        if not node:
            del self._nodes[h]
