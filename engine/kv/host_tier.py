"""The host-memory tier of the prefix cache (SGLang's HiCache L2): a second page pool in DRAM.

Pages the prefix cache evicts from the device pool are *spilled* (backed up) to this
pool instead of being forgotten, and a later prefix hit on them *loads them back* into
freshly allocated device pages (SGLang's ``HiRadixCache`` over ``HostKVCache``,
python/sglang/srt/mem_cache/hiradix_cache.py and memory_pool_host.py; the write-back
policy: a page is copied to the host when it leaves the device, not before).

Three pieces, one owner each:

- `HostKVPool` holds the bytes: one tensor shaped like the device pool,
  ``[num_pages + 1, num_layers, 2, num_kv_heads, page_size, head_dim]`` in the pool's
  storage dtype (uint8 bits for FP8, so pages come back bit-identical; the FP8
  scales are per layer and fixed, so they need no copy). On a CUDA device the
  tensor is pinned and copies run ``non_blocking`` on a side stream that first waits
  for the compute stream; the compute stream then waits for the copies on the GPU,
  so the CPU goes on scheduling while they run. On CPU the copies are plain and
  synchronous. Page-major layout makes each page one contiguous block, and runs of
  consecutive pages are copied as one slice.
- `HostTier` owns which host pages are used: its own `PageAllocator` (page 0 is
  unused, as on the device) and an LRU over the tree nodes that hold a host copy.
  It counts what moved (``hicache_backup`` and ``load_back`` pages, SGLang's names).
- `pd_cluster.engine.kv.hiradix_cache.HiRadixCache` decides residency: which node is
  on the device, on the host, or both.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.pool import KVPool

Pairs = Sequence[tuple[int, int]]  # (source page, destination page)


class PageCopier(Protocol):
    """Moves page bytes between the device pool and the host pool."""

    def backup(self, pairs: Pairs) -> None:
        """Copy device pages to host pages: pairs of (device page, host page)."""

    def load_back(self, pairs: Pairs) -> None:
        """Copy host pages to device pages: pairs of (host page, device page)."""


def page_runs(pairs: Pairs) -> list[tuple[int, int, int]]:
    """Group (src, dst) pairs into runs of consecutive pages on both sides: (src, dst, length)."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(s, d, n) for s, d, n in runs]


class HostKVPool:
    """Host-memory copy space for pages of one device `KVPool`.

    Args:
        device_pool: the pool whose pages this one backs up.
        num_pages: host pages (page 0 comes on top and is never used).

    On CUDA the tensor is pinned (page-locked) so copies can be asynchronous; on CPU it is
    zero-filled so its memory is really committed, as the device pool is.
    """

    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the host tier needs at least one page, got {num_pages}")
        self.device_pool = device_pool
        self.num_pages = num_pages
        shape = (num_pages + 1, *device_pool.kv.shape[1:])
        cuda = device_pool.device.type == "cuda"
        if cuda:
            self.kv = torch.empty(shape, dtype=device_pool.kv.dtype, pin_memory=True)
            self._stream: torch.cuda.Stream | None = torch.cuda.Stream(device_pool.device)
        else:
            self.kv = torch.zeros(shape, dtype=device_pool.kv.dtype)
            self._stream = None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def backup(self, pairs: Pairs) -> None:
        self._copy(pairs, self.device_pool.kv, self.kv)

    def load_back(self, pairs: Pairs) -> None:
        self._copy(pairs, self.kv, self.device_pool.kv)

    def _copy(self, pairs: Pairs, src: torch.Tensor, dst: torch.Tensor) -> None:
        runs = page_runs(pairs)
        if not runs:
            return
        if self._stream is None:
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n])
            return
        compute = torch.cuda.current_stream(self.device_pool.device)
        self._stream.wait_stream(compute)  # the KV being read (or pages being overwritten) is final
        with torch.cuda.stream(self._stream):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
        compute.wait_stream(self._stream)  # the next forward pass sees the loaded pages

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of the raw bytes of host `pages`; for checks and tests."""
        if self._stream is not None:
            self._stream.synchronize()
        return self.kv[torch.tensor(pages, dtype=torch.long)].clone()


class HostTier:
    """The host pool's allocator, its LRU and its counters.

    Args:
        num_pages: host pages.
        page_size: tokens per page (for token counts).
        copier: moves the bytes (`HostKVPool`; tests pass a model).

    Entries of the LRU are tree nodes with a host copy (``node.host_page != 0``), ordered by
    ``node.stamp``. Stamps change elsewhere (a match touches a node); an entry whose stamp is
    old is pushed again with the node's stamp when it surfaces, so the order stays LRU
    without the cache telling this class about every touch.

    Attributes:
        backup_pages_total: pages copied device -> host (SGLang's ``hicache_backup_tokens`` / page_size).
        load_back_pages_total: pages copied host -> device (SGLang's ``load_back_tokens`` / page_size).
        dropped_pages_total: host copies given up to make room.
    """

    def __init__(self, num_pages: int, page_size: int, copier: PageCopier) -> None:
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.page_size = page_size
        self.copier = copier
        self.backup_pages_total = 0
        self.load_back_pages_total = 0
        self.dropped_pages_total = 0
        self._lru: list[tuple[int, int, object]] = []
        self._seq = itertools.count()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        """Host pages holding a copy of some node's KV."""
        return self.allocator.num_used

    @property
    def max_total_num_tokens(self) -> int:
        """Capacity in tokens (SGLang's ``hicache_host_total_tokens``)."""
        return self.num_pages * self.page_size

    # ---- pages ---------------------------------------------------------------------------
    def alloc(self, can_drop: Callable[[object], bool], drop: Callable[[object], None]) -> int:
        """One host page: a free one, else the least recently used droppable entry's.

        Args:
            can_drop: whether a node's host copy may be given up now.
            drop: gives it up; must call `free` on the node's host page.

        Returns:
            The page id, or 0 when every used page is pinned by `can_drop`.
        """
        if self.allocator.num_free == 0:
            victim = self._pop_lru(can_drop)
            if victim is None:
                return 0
            drop(victim)
            self.dropped_pages_total += 1
        return self.allocator.allocate(1)[0]

    def free(self, page: int) -> None:
        """Return a host page (its node no longer holds a copy)."""
        self.allocator.free([page])

    def track(self, node) -> None:
        """Enter `node` (which just got a host copy, or lost its device one) in the LRU."""
        heapq.heappush(self._lru, (node.stamp, next(self._seq), node))
        if len(self._lru) > 2 * self.allocator.num_used + 64:
            self._compact()

    def _pop_lru(self, can_drop: Callable[[object], bool]):
        kept = []
        victim = None
        while self._lru:
            stamp, seq, node = heapq.heappop(self._lru)
            if node.evicted or node.host_page == 0:
                continue  # gone, or its copy was already given up
            if stamp != node.stamp:  # touched since: its place is later
                heapq.heappush(self._lru, (node.stamp, next(self._seq), node))
                continue
            if not can_drop(node):
                kept.append((stamp, seq, node))
                continue
            victim = node
            break
        for entry in kept:
            heapq.heappush(self._lru, entry)
        return victim

    def _compact(self) -> None:
        latest = {id(n): n for _, _, n in self._lru if not n.evicted and n.host_page}
        self._lru = [(n.stamp, next(self._seq), n) for n in latest.values()]
        heapq.heapify(self._lru)

    # ---- bytes ---------------------------------------------------------------------------
    def backup(self, pairs: Pairs) -> None:
        """Copy (device page, host page) pairs to the host."""
        self.copier.backup(pairs)
        self.backup_pages_total += len(pairs)

    def load_back(self, pairs: Pairs) -> None:
        """Copy (host page, device page) pairs back to the device."""
        self.copier.load_back(pairs)
        self.load_back_pages_total += len(pairs)
