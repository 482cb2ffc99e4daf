"""The paged KV cache: the page allocator (pure Python) and the pool tensor that owns layout and quantisation."""

from pd_cluster.engine.kv.allocator import NULL_PAGE, OutOfPagesError, PageAllocator
from pd_cluster.engine.kv.pool import KVLayout, KVPool

__all__ = ["NULL_PAGE", "OutOfPagesError", "PageAllocator", "KVLayout", "KVPool"]
