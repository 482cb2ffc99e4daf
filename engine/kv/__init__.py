"""The paged KV cache: the page allocator (pure Python), the prefix cache over it, and the pool tensor that owns
layout and quantisation.

The names below load on first use (PEP 562), so the torch-free parts (`events`, `text_map`, the allocator) import
without torch: the load generator's fake worker (`bench/fake_kv.py`) publishes KV events with them.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"NULL_PAGE": "allocator", "OutOfPagesError": "allocator", "PageAllocator": "allocator",
          "PrefixCache": "prefix_cache", "KVLayout": "pool", "KVPool": "pool"}

__all__ = ["NULL_PAGE", "OutOfPagesError", "PageAllocator", "PrefixCache", "KVLayout", "KVPool"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
