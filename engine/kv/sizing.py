"""How many pages the KV pool gets: from a memory budget, never from the context length.

GPU: ``--mem-fraction-static`` (SGLang's flag) is the fraction of the device
that this worker's weights and KV pool may take. After the weights are loaded,
the pool gets that share minus what this process already holds
(``budget = total * mem_fraction_static - held``, ``held`` being torch's
reserved memory: the weights and any other tensors); a budget over what is
free is refused with an error that names both.
The rest of the device is left for activations, CUDA graphs, the CUDA context
and other processes. Memory is counted per process, as `pd-plan` does and as
vLLM documents its ``--gpu-memory-utilization`` (a per-instance limit). SGLang's
own rule, ``free - total * (1 - mem_fraction_static)``, gives the same budget
to a worker alone on its device but counts every other process's memory
against it, so the second of two workers sharing a device gets nothing: on an
H100, a 1P1D ``pd-serve`` with ``--mem-fraction-static 0.1`` per worker
stopped with "KV cache budget 0 B" in the decode worker under that rule.
``--kv-cache-memory`` replaces the rule with an explicit number of bytes.

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
class DeviceMemory:
    """One reading of a device's memory, in bytes: `free` and `total` (``cudaMemGetInfo``), and `held`, what
    this process's torch allocator has reserved on it."""

    free: int
    total: int
    held: int

    @classmethod
    def read(cls, device: torch.device) -> "DeviceMemory":
        free, total = torch.cuda.mem_get_info(device)
        return cls(int(free), int(total), int(torch.cuda.memory_reserved(device)))


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


def plan_pool(layout: KVLayout, cache: CacheConfig, device: torch.device,
              memory: DeviceMemory | None = None) -> PoolPlan:
    """Size the pool for `layout` on `device`.

    Args:
        memory: the device's memory reading (GPU; default: read now, after the weights are loaded).

    Raises:
        ValueError: the budget holds less than one page, or exceeds the memory available.
    """
    page = layout.page_nbytes
    if device.type == "cuda":
        memory = memory or DeviceMemory.read(device)
        available = memory.free
        if cache.kv_cache_memory is not None:
            budget, source = cache.kv_cache_memory, "kv_cache_memory"
        else:
            budget = int(memory.total * cache.mem_fraction_static) - memory.held
            source = "mem_fraction_static"
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
