"""Grows and frees a request's block table on top of the page allocator.

A small manager in mini-sglang's style: the scheduler asks it whether a
request's next tokens fit and to make room; it never decides who runs.
"""

from __future__ import annotations

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.request import Request


class PageManager:
    """Pages for requests, taken on demand as sequences grow.

    Args:
        allocator: the pool's page allocator.
        page_size: tokens per page.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def extra_pages(self, req: Request, num_tokens: int) -> int:
        """Pages `req` lacks to hold its first `num_tokens` tokens."""
        return max(self.pages_for(num_tokens) - len(req.block_table), 0)

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.extra_pages(req, num_tokens))

    def grow(self, req: Request, num_tokens: int) -> list[int]:
        """Append pages so `req` holds `num_tokens` tokens; returns the new page ids.

        Raises:
            OutOfPagesError: not enough free pages (the block table is unchanged).
        """
        new = self.allocator.allocate(self.extra_pages(req, num_tokens))
        req.block_table.extend(new)
        return new

    def release(self, req: Request) -> None:
        """Free all pages of `req` and empty its block table."""
        if req.block_table:
            self.allocator.free(req.block_table)
            req.block_table = []

    @property
    def free_tokens(self) -> int:
        return self.allocator.num_free * self.page_size

    @property
    def token_usage(self) -> float:
        """Used pages over all pages, 0..1 (SGLang's ``token usage``)."""
        return self.allocator.num_used / self.allocator.num_pages
