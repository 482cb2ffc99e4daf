"""How many pages the KV pool gets: from a memory budget, never from the context length.

GPU: SGLang's rule. After the weights are loaded, the pool gets what is free
minus the share of the device that ``--mem-fraction-static`` leaves for
activations, CUDA graphs and other processes:
``budget = free - total * (1 - mem_fraction_static)``.
``--kv-cache-memory`` replaces that with an explicit number of bytes.

CPU: an explicit ``--kv-cache-memory`` (default 256 MiB), checked against the
host memory that is available.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from pd_cluster.engine.config import CacheConfig, format_size
from pd_cluster.engine.kv.pool import KVLayout

DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 2**20


@dataclass(frozen=True)
class PoolPlan:
    """The pool's size and where it came from.

    Attributes:
        num_pages: usable pages (the null page comes on top).
        budget_bytes: bytes granted to the pool.
        available_bytes: memory free on the device when sizing (after the weights).
        source: which setting decided: ``num_pages``, ``kv_cache_memory``,
            ``mem_fraction_static`` or ``cpu_default``.
    """

    num_pages: int
    budget_bytes: int
    available_bytes: int
    source: str


def plan_pool(layout: KVLayout, cache: CacheConfig, device: torch.device) -> PoolPlan:
    """Size the pool for `layout` on `device`.

    Raises:
        ValueError: the budget holds less than one page, or exceeds the memory available.
    """
    page = layout.page_nbytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        available = free
        if cache.kv_cache_memory is not None:
            budget, source = cache.kv_cache_memory, "kv_cache_memory"
        else:
            budget, source = int(free - total * (1.0 - cache.mem_fraction_static)), "mem_fraction_static"
    else:
        available = psutil.virtual_memory().available
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_MEMORY
        source = "kv_cache_memory" if cache.kv_cache_memory is not None else "cpu_default"
    if cache.num_pages is not None:
        budget, source = (cache.num_pages + 1) * page, "num_pages"
    if budget > available:
        raise ValueError(f"KV cache budget {format_size(budget)} exceeds the {format_size(available)} "
                         f"available on {device}; lower --kv-cache-memory or --mem-fraction-static")
    num_pages = budget // page - 1  # one page is the null page
    if num_pages < 1:
        raise ValueError(f"KV cache budget {format_size(max(budget, 0))} holds no page of {format_size(page)} "
                         f"(page_size={layout.page_size}); raise --kv-cache-memory or --mem-fraction-static")
    return PoolPlan(int(num_pages), int(budget), int(available), source)


@dataclass(frozen=True)
class HostPlan:
    """The host tier's size and where it came from.

    Attributes:
        num_pages: host pages (the unused page 0 comes on top, as on the device).
        budget_bytes: bytes of those pages.
        source: ``hicache_size`` or ``hicache_ratio``.
    """

    num_pages: int
    budget_bytes: int
    source: str


def plan_host_pool(layout: KVLayout, cache: CacheConfig, device_pages: int) -> HostPlan:
    """Size the host tier: ``--hicache-size`` bytes, else ``--hicache-ratio`` x the device pool's pages
    (SGLang's HostKVCache rule); never from the context length.

    Raises:
        ValueError: the size holds no page, or exceeds the host memory available.
    """
    page = layout.page_nbytes
    if cache.hicache_size is not None:
        num_pages, source = cache.hicache_size // page, "hicache_size"
    else:
        num_pages, source = int(device_pages * cache.hicache_ratio), "hicache_ratio"
    if num_pages < 1:
        raise ValueError(f"the host tier ({source}) holds no page of {format_size(page)}; raise --hicache-size "
                         "or --hicache-ratio")
    budget = (num_pages + 1) * page
    available = psutil.virtual_memory().available
    if budget > available:
        raise ValueError(f"host tier budget {format_size(budget)} exceeds the {format_size(available)} of host "
                         "memory available; lower --hicache-size or --hicache-ratio")
    return HostPlan(int(num_pages), int(budget), source)
