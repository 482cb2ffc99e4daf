"""The paged KV cache: the page allocator (pure Python) and the pool tensor that owns layout and quantisation."""

from engine.kv.allocator import NULL_PAGE, OutOfPagesError, PageAllocator
from engine.kv.pool import KVLayout, KVPool

__all__ = ["NULL_PAGE", "OutOfPagesError", "PageAllocator", "KVLayout", "KVPool"]
