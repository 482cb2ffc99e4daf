"""Acceptance: the host-memory tier of the prefix cache (``--enable-hierarchical-cache``, SGLang's HiCache L2).

A device pool too small for the workload evicts cached pages; with the host tier
they spill to host memory and load back on a later hit. Greedy outputs equal the
outputs with caching off, token for token (page sizes 1 and 16, fp32 and FP8 KV,
``--chunked-prefill-size 7``), and the counters show that loads really happened.
Host pages round-trip bit for bit; the flags follow SGLang's meanings; with the
flag off no host tier exists.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from test_prefix_cache_exact import GREEDY, cache_off, shared_prefix_prompts

from pd_cluster.engine import LLM
from pd_cluster.engine.args import add_engine_args, config_from_args, config_from_kwargs
from pd_cluster.engine.kv.hiradix_cache import HiRadixCache
from pd_cluster.engine.kv.host_tier import HostKVPool, page_runs
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.kv.prefix_cache import PrefixCache
from pd_cluster.engine.llm_engine import LLMEngine


def tiny_pool_pages(page_size: int) -> int:
    """Device pages that hold ~300 tokens: two requests of the workload, so the cache must evict."""
    return 300 // page_size


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_offline_host_tier_equals_cache_off_and_loads_happen(kv, page_size):
    prompts = [list(p) for p in shared_prefix_prompts()]
    expected = cache_off(kv, page_size)
    llm = LLM(kv_cache_dtype=kv, page_size=page_size, num_pages=tiny_pool_pages(page_size), chunked_prefill_size=7,
              max_running_requests=2, enable_hierarchical_cache=True, hicache_ratio=3.0)
    engine = llm.engine
    assert isinstance(engine.prefix_cache, HiRadixCache) and engine.host_tier.num_pages == 3 * engine.allocator.num_pages
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)  # the first round's pages were pushed to the host by later prompts
    assert [tuple(o.token_ids) for o in first] == list(expected)
    assert [tuple(o.token_ids) for o in second] == list(expected)
    host, st = engine.host_tier, engine.stats
    assert host.backup_pages_total > 0 and host.load_back_pages_total > 0
    assert st.external_prefix_cache_hits > 0 and st.external_prefix_cache_hits % page_size == 0
    assert st.external_prefix_cache_queries == st.prefix_cache_queries == 2 * sum(map(len, prompts))
    # Every admission's cached tokens came from the device tree or the host tier, and nothing else.
    assert st.prefix_cache_hits + st.external_prefix_cache_hits == sum(o.num_cached_tokens for o in first + second)
    assert host.load_back_pages_total * page_size >= st.external_prefix_cache_hits
    assert engine.pages.num_in_use == 0 and engine.num_free_pages() == engine.allocator.num_pages


def test_host_tier_serves_what_the_device_cache_alone_lost():
    """Same workload, same device pool: the host tier turns recomputed prompt tokens into hits."""
    prompts = [list(p) for p in shared_prefix_prompts()]
    kw = dict(page_size=16, num_pages=tiny_pool_pages(16), chunked_prefill_size=7, max_running_requests=2)
    runs = {}
    for on in (False, True):
        llm = LLM(enable_hierarchical_cache=on, **kw)
        outs = llm.generate(prompts, GREEDY) + llm.generate(prompts, GREEDY)
        runs[on] = (llm.engine.stats.prompt_tokens_total, sum(o.num_cached_tokens for o in outs))
    (computed_off, cached_off), (computed_on, cached_on) = runs[False], runs[True]
    assert computed_on + cached_on == computed_off + cached_off  # the same prompts, split differently
    assert cached_on > cached_off and computed_on < computed_off


def test_retraction_with_the_host_tier_stays_exact():
    prompts = [list(p) for p in shared_prefix_prompts()]
    llm = LLM(page_size=16, num_pages=24, chunked_prefill_size=7, schedule_conservativeness=0.1,
              enable_hierarchical_cache=True, hicache_ratio=0.5)  # a host pool that must drop copies too
    outs = llm.generate(prompts, GREEDY) + llm.generate(prompts[::-1], GREEDY)
    assert [tuple(o.token_ids) for o in outs] == list(cache_off("fp32", 16)) + list(cache_off("fp32", 16)[::-1])
    engine = llm.engine
    assert engine.scheduler.num_retracted_total > 0 and engine.host_tier.load_back_pages_total > 0
    assert engine.host_tier.dropped_pages_total > 0
    assert engine.num_free_pages() == engine.allocator.num_pages


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3"])
def test_host_pages_round_trip_bit_for_bit(kv):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, kv_cache_dtype=kv,
                      k_scales=(0.5, 2.0), v_scales=(1.0, 0.25))
    pool = KVPool(layout, 10, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    if pool.kv.dtype == torch.uint8:  # every FP8 bit pattern, NaNs included
        pool.kv.copy_(torch.randint(0, 256, pool.kv.shape, dtype=torch.uint8, generator=g))
    else:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    host = HostKVPool(pool, 6)
    src = [3, 4, 5, 9, 1]
    before = pool.read_pages(src)
    host.backup(list(zip(src, [2, 3, 4, 6, 1])))
    assert torch.equal(host.read_pages([2, 3, 4, 6, 1]), before)
    pool.kv.zero_()
    host.load_back(list(zip([2, 3, 4, 6, 1], [7, 8, 2, 1, 10])))
    assert torch.equal(pool.read_pages([7, 8, 2, 1, 10]).view(torch.uint8), before.view(torch.uint8))
    assert pool.read_pages([3, 4, 5, 9]).count_nonzero() == 0  # nothing else was written


def test_runs_merge_consecutive_pages_on_both_sides():
    assert page_runs([(3, 2), (4, 3), (5, 4), (9, 6), (1, 1), (2, 2), (7, 9)]) == [(3, 2, 3), (9, 6, 1), (1, 1, 2),
                                                                             (7, 9, 1)]
    assert page_runs([]) == []


def test_flags_follow_sglang():
    parser = add_engine_args(argparse.ArgumentParser())
    cache = config_from_args(parser.parse_args([])).cache
    assert not cache.enable_hierarchical_cache and cache.hicache_ratio == 2.0 and cache.hicache_size is None
    cache = config_from_args(parser.parse_args(["--enable-hierarchical-cache", "--hicache-ratio", "3",
                                                "--hicache-size", "2"])).cache
    assert cache.enable_hierarchical_cache and cache.hicache_ratio == 3.0 and cache.hicache_size == 2 * 10**9
    assert config_from_args(parser.parse_args(["--hicache-size", "512MiB"])).cache.hicache_size == 512 * 2**20
    assert config_from_args(parser.parse_args(["--hicache-size", "0"])).cache.hicache_size is None  # ratio applies
    with pytest.raises(ValueError, match="mutually exclusive"):
        config_from_kwargs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="tp_size > 1"):
        config_from_kwargs(enable_hierarchical_cache=True, tp_size=2)
    with pytest.raises(ValueError, match="hicache_ratio must be > 0"):
        config_from_kwargs(hicache_ratio=0.0)


def test_flag_off_means_no_host_tier():
    engine = LLM(page_size=16, num_pages=20).engine
    assert type(engine.prefix_cache) is PrefixCache and engine.host_tier is None
    decode = LLMEngine(config_from_kwargs(role="decode", enable_hierarchical_cache=True))
    assert type(decode.prefix_cache) is PrefixCache and decode.host_tier is None  # decode keeps device pages only


def test_sized_by_ratio_or_size_never_by_context_length_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        a = LLM(page_size=16, num_pages=50, enable_hierarchical_cache=True, context_length=256).engine
        b = LLM(page_size=16, num_pages=50, enable_hierarchical_cache=True, context_length=512).engine
    assert a.host_tier.num_pages == b.host_tier.num_pages == 100  # default ratio 2.0
    assert a.host_tier.max_total_num_tokens == 1600
    page_nbytes = a.layout.page_nbytes
    c = LLM(page_size=16, num_pages=50, enable_hierarchical_cache=True, hicache_size=37 * page_nbytes + 5).engine
    assert c.host_tier.num_pages == 37  # --hicache-size overrides the ratio
    lines = [m for m in caplog.messages if m.startswith("Allocating ") and "hierarchical KV cache" in m]
    assert len(lines) == 2 and "100 pages, 1600 tokens (hicache_ratio=2" in lines[0]
    assert any("prefix_cache=hierarchical" in m for m in caplog.messages)
