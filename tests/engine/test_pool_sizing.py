"""The GPU pool-sizing rule, on memory readings: per-process fraction, two workers sharing one device.

The first GPU run of a 1P1D cluster on one H100 (both roles on the device,
``--mem-fraction-static 0.1`` each) stopped in the decode worker with "KV cache
budget 0 B": SGLang's ``free - total * (1 - fraction)`` counted the prefill
worker's memory against the decode worker. These tests replay that start-up on
readings, without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.config import CacheConfig
from pd_cluster.engine.kv.pool import KVLayout
from pd_cluster.engine.kv.sizing import DeviceMemory, plan_pool

GiB = 2**30
CUDA = torch.device("cuda", 0)  # only its type is read when a reading is given
LAYOUT = KVLayout(32, 8, 128, 64, "fp8_e4m3", (1.0,) * 32, (1.0,) * 32)  # Llama-3.1-8B FP8: 4 MiB pages


def test_a_worker_alone_gets_its_fraction_minus_its_weights():
    weights, context = 16 * GiB, GiB // 2
    mem = DeviceMemory(free=80 * GiB - weights - context, total=80 * GiB, held=weights)
    plan = plan_pool(LAYOUT, CacheConfig(mem_fraction_static=0.88), CUDA, mem)
    assert plan.budget_bytes == int(80 * GiB * 0.88) - weights
    assert plan.num_pages == plan.budget_bytes // LAYOUT.page_nbytes - 1
    assert plan.source == "mem_fraction_static"
    # alone on the device this is SGLang's rule give or take the CUDA context it also subtracts
    assert abs(plan.budget_bytes - (mem.free - 80 * GiB * (1 - 0.88))) <= context


@pytest.mark.parametrize("fraction", [0.1, 0.44])
def test_two_workers_sharing_a_device_both_get_their_share(fraction):
    total, weights, context = 80 * GiB, GiB, GiB // 2
    first = plan_pool(LAYOUT, CacheConfig(mem_fraction_static=fraction), CUDA,
                      DeviceMemory(free=total - context - weights, total=total, held=weights))
    used_by_first = context + weights + first.budget_bytes
    second = plan_pool(LAYOUT, CacheConfig(mem_fraction_static=fraction), CUDA,
                       DeviceMemory(free=total - used_by_first - context - weights, total=total, held=weights))
    assert second.num_pages == first.num_pages > 0
    # SGLang's rule would have left the second worker nothing
    assert (total - used_by_first - context - weights) - total * (1 - fraction) < LAYOUT.page_nbytes


def test_a_share_larger_than_the_free_memory_is_refused_with_both_numbers():
    mem = DeviceMemory(free=10 * GiB, total=80 * GiB, held=GiB)
    with pytest.raises(ValueError, match=r"exceeds the 10\.00 GiB available"):
        plan_pool(LAYOUT, CacheConfig(mem_fraction_static=0.5), CUDA, mem)


def test_kv_cache_memory_overrides_the_fraction():
    mem = DeviceMemory(free=70 * GiB, total=80 * GiB, held=16 * GiB)
    plan = plan_pool(LAYOUT, CacheConfig(kv_cache_memory=8 * GiB), CUDA, mem)
    assert (plan.budget_bytes, plan.source) == (8 * GiB, "kv_cache_memory")
