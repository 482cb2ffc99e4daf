"""Page allocator: which pages of the KV pool are free, with reference counts.

Pure Python (no torch), as in vLLM's block pool and mini-sglang's cache
manager. Page 0 is the reserved null page: padded block-table entries point at
it and it is never handed out, so a stray read of padding stays in bounds.

Free pages are handed out lowest id first (a heap). Fresh requests thus get
runs of consecutive pages, which the transfer layer merges into fewer, larger
NIXL descriptors.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(f"KV pool out of pages: requested {requested}, free {free} of {total}")
        self.requested = requested
        self.free = free
        self.total = total


class PageAllocator:
    """Hands out page ids in ``1..num_pages`` (0 is the null page).

    Args:
        num_pages: usable pages, not counting the null page.

    A page is free when its reference count is 0. `allocate` sets the count to
    1; `incref` lets a second owner share a page (prefix sharing); `free`
    decrements and returns the page to the free heap at 0.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * (num_pages + 1)
        self._refcount[NULL_PAGE] = 1  # never free
        self._free: list[int] = list(range(1, num_pages + 1))  # already a valid heap
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, lowest ids first.

        Raises:
            OutOfPagesError: fewer than `n` pages are free (nothing is taken).
        """
        if n > self._num_free:
            raise OutOfPagesError(n, self._num_free, self.num_pages)
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        self._num_free -= n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add an owner to pages that are in use.

        Raises:
            ValueError: a page is free or is the null page.
        """
        for p in pages:
            if p == NULL_PAGE or self._refcount[p] == 0:
                raise ValueError(f"incref of page {p}, which is not in use")
            self._refcount[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one owner of each page; pages with no owner left become free.

        Raises:
            ValueError: double free, or freeing the null page.
        """
        for p in pages:
            if p == NULL_PAGE or self._refcount[p] <= 0:
                raise ValueError(f"free of page {p}, which is not in use (double free?)")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                heapq.heappush(self._free, p)
                self._num_free += 1

    def refcount(self, page: int) -> int:
        return self._refcount[page]
