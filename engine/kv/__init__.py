"""The paged KV cache: the page allocator (pure Python), the prefix cache over it, and the pool tensor that owns
layout and quantisation."""

from pd_cluster.engine.kv.allocator import NULL_PAGE, OutOfPagesError, PageAllocator
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.kv.prefix_cache import PrefixCache

__all__ = ["NULL_PAGE", "OutOfPagesError", "PageAllocator", "PrefixCache", "KVLayout", "KVPool"]
