"""The hybrid KV manager: KV cache groups by attention type, window pages freed as the window moves.

Tiny random checkpoints written by transformers (`random_models`), greedy tokens compared with transformers'
own greedy loop. A window-capped pool serves a prompt whose KV would not fit if the window layers kept every
token; pages held per group stay bounded over a long request and every page is free at the end.
"""

from __future__ import annotations

import pytest
import torch
from random_models import build, hf_greedy_full, long_prompt_ids

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.errors import PoolCapacityExceeded
from pd_cluster.engine.kv.allocator import NULL_PAGE
from pd_cluster.engine.kv.groups import KVGroup, KVGroups, plan_kv_groups, single_group
from pd_cluster.engine.layer_attention import LayerAttention

FULL = LayerAttention()


def sliding(w: int) -> LayerAttention:
    return LayerAttention("sliding", window=w)


def chunked(c: int) -> LayerAttention:
    return LayerAttention("chunked", chunk_size=c)


# ---- grouping (pure) ----------------------------------------------------------------------------------------

def test_full_model_is_one_group_in_layer_order():
    groups = plan_kv_groups((FULL,) * 5)
    assert groups.is_single and groups.layers_per_page == 5 and groups == single_group(5)


def test_llama4_scout_groups_as_vllm_unifies_page_size():
    """48 layers, every 4th full (NoPE), the rest chunked (8192): 12 layers a page, 1 full + 3 chunked groups."""
    layers = tuple(FULL if (i + 1) % 4 == 0 else chunked(8192) for i in range(48))
    groups = plan_kv_groups(layers)
    assert groups.layers_per_page == 12
    assert [g.rule for g in groups.groups] == [("full", 0)] + [("chunked", 8192)] * 3
    assert groups.groups[0].layers == tuple(range(3, 48, 4))
    assert sorted(sum((g.layers for g in groups.groups), ())) == list(range(48))
    for layer in range(48):  # every layer has its own slot of its group's pages
        g = groups.groups[groups.group_of_layer[layer]]
        assert g.layers[groups.slot_of_layer[layer]] == layer


def test_gemma3_pattern_and_uneven_counts():
    layers = tuple(sliding(512) if (i + 1) % 6 else FULL for i in range(26))  # 22 sliding, 4 full
    groups = plan_kv_groups(layers)
    assert groups.layers_per_page == 4
    assert [len(g.layers) for g in groups.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert groups.groups[0].kind == "full"


def test_window_page_arithmetic():
    ps = 16
    win = KVGroup(("sliding", 16), (0,))
    assert win.first_visible(100) == 85 and win.first_needed_page(100, ps) == 5
    assert win.max_pages(1800, 256, ps) == -(-(15 + 256) // ps) + 1 == 18
    assert win.max_pages(10, 256, ps) == 1  # never more than the tokens' pages
    chunk = KVGroup(("chunked", 32), (0,))
    assert chunk.first_visible(70) == 64 and chunk.first_needed_page(70, ps) == 4
    full = KVGroup(("full", 0), (0,))
    assert full.first_needed_page(10**6, ps) == 0 and full.max_pages(1800, 256, ps) == 113
    assert KVGroups((full, win), 2).max_pages(1800, 256, ps) == 113 + 18


# ---- the engine ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
POOL_192K = 192 * 1024


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Mistral, every layer a 16-token window."""
    folder = tmp_path_factory.mktemp("mistral-window16")
    return folder, build("mistral-window16", folder, max_position_embeddings=4096)


def _long_prompt(n: int) -> list[int]:
    base = long_prompt_ids(5)
    ids: list[int] = []
    while len(ids) < n:
        ids += base[len(ids) % 5]
    return ids[:n]


def test_window_capped_pool_serves_a_prompt_whose_full_kv_would_not_fit(mistral):
    """1,800-token prompt, 192 KiB pool: every token's KV would need far more pages than the pool has; the
    windowed group holds ~a chunk plus a window and the tokens equal transformers' greedy loop."""
    folder, hf = mistral
    prompt = _long_prompt(1800)
    kw = dict(kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=256, kv_cache_memory=POOL_192K,
              attention_backend="cpu")
    llm = LLM(str(folder), **kw)
    engine = llm.engine
    tokens_in_pool = engine.pool.max_total_num_tokens
    assert tokens_in_pool < 1800  # the whole prompt's KV does not fit
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert list(out.token_ids) == hf_greedy_full(hf, prompt, params.max_tokens)
    assert engine.pages.num_trimmed_total > 1800 // 16 - 20  # pages behind the window went back to the pool
    assert engine.num_free_pages() == engine.allocator.num_pages
    # one group, as before (every layer's KV for every token): the same request is refused up front
    old = LLM(str(folder), disable_hybrid_kv_cache_manager=True, **kw)
    assert old.engine.pool.max_total_num_tokens <= tokens_in_pool
    with pytest.raises(PoolCapacityExceeded):
        old.generate([prompt], params)


def test_torch_backend_reads_each_groups_table(tmp_path):
    """Llama 4 (chunk 16 + full NoPE layers): two groups, the torch path; exact and leak-free."""
    hf = build("llama4", tmp_path)
    prompts = long_prompt_ids(3)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7, attention_backend="torch")
    assert llm.engine.kv_groups.num_groups == 2 and llm.engine.layout.page_layers == 2
    outs = llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy_full(hf, ids, GREEDY.max_tokens)
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages


def test_pages_per_group_stay_bounded_over_a_long_request(tmp_path):
    """Gemma 2 layout (sliding 16 / full alternating): step by step, the sliding group holds at most
    `KVGroup.max_pages`; the full group grows with the sequence; nothing is held at the end."""
    build("gemma2", tmp_path, max_position_embeddings=2048)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=32, attention_backend="cpu")
    engine = llm.engine
    groups = engine.kv_groups
    win = next(i for i, g in enumerate(groups.groups) if g.is_windowed)
    full = next(i for i, g in enumerate(groups.groups) if not g.is_windowed)
    bound = groups.groups[win].max_pages(10**6, 32, 16)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(None, _long_prompt(500), params)
    req = engine.requests[rid]
    most = [0] * groups.num_groups
    steps = 0
    while engine.has_work() and steps < 2000:
        start = req.num_computed_tokens
        engine.step()
        steps += 1
        if req.block_table:
            held = engine.pages.held_pages(req)
            most = [max(a, b) for a, b in zip(most, held)]
            assert held[win] <= bound
            assert -(-req.num_computed_tokens // 16) <= held[full] <= -(-req.num_tokens // 16)
            dead = groups.groups[win].first_needed_page(start, 16)  # behind the window of the step's first query
            assert all(p == NULL_PAGE for p in engine.pages.tables(req)[win][:dead])
    assert not engine.has_work()
    assert most[full] == -(-(500 + 300) // 16) and 2 <= most[win] <= bound
    assert engine.num_free_pages() == engine.allocator.num_pages
    assert engine.runner.rows.num_used == 0  # every group's block-table row was released


def test_non_hybrid_model_keeps_one_group_and_its_layout(tmp_path):
    build("gemma2", tmp_path)
    one = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, disable_hybrid_kv_cache_manager=True,
              attention_backend="cpu")
    assert one.engine.kv_groups.is_single and "layers_per_page" not in one.engine.layout.to_dict()
    assert one.engine.prefix_cache is not None
    assert tuple(one.engine.pool.kv.shape[1:2]) == (4,)
    assert torch.equal(torch.tensor(one.engine.kv_groups.slot_of_layer), torch.arange(4))


def engine_overlaps(llm: LLM) -> bool:
    return llm.engine.overlap.enabled


# ---- prefix cache per group ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma2", "llama4", "mistral-window16"])
def test_cached_hit_is_exact_and_needs_only_the_window(family, tmp_path):
    """A second request sharing a long prefix starts on the cache (full groups: every page; windowed groups:
    only the pages its first query sees) and gives transformers' tokens, as the cold request does."""
    hf = build(family, tmp_path, max_position_embeddings=2048)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=32, attention_backend="cpu")
    engine = llm.engine
    shared = _long_prompt(200)
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    cold = llm.generate([first], GREEDY)[0]
    assert list(cold.token_ids) == hf_greedy_full(hf, first, GREEDY.max_tokens)
    evictable = engine.pages.num_evictable
    assert evictable > 0 and engine.num_free_pages() == engine.allocator.num_pages  # cached, none held
    # KV events (cache-aware routing) describe group 0's tree: one page hash per cached page of it, no other group's
    assert engine.kv_events.num_pages == engine.prefix_cache.trees[0].num_pages == (len(first) + 23) // 16
    rid = engine.add_request(None, second, GREEDY)
    req = engine.requests[rid]
    engine.step()
    hit = req.num_cached_tokens
    assert hit == 192  # 12 full pages of the 200 shared tokens
    for group, table in zip(engine.kv_groups.groups, engine.pages.tables(req)):
        first_live = group.first_needed_page(hit, 16)
        assert all(p == NULL_PAGE for p in table[:first_live]) and all(p != NULL_PAGE for p in table[first_live:])
        assert first_live == (0 if not group.is_windowed else (hit - (15 if group.kind == "sliding" else 0)) // 16)
    while engine.has_work():
        engine.step()
    warm = llm.generate([second], GREEDY)[0]
    assert warm.num_cached_tokens >= hit
    assert list(warm.token_ids) == hf_greedy_full(hf, second, GREEDY.max_tokens)
    assert engine.num_free_pages() == engine.allocator.num_pages


def test_window_tree_hollows_inner_pages_and_a_hit_still_needs_the_window(tmp_path):
    """Evicting a windowed group's inner pages (behind every window) keeps hits; evicting the pages a hit's
    window needs shortens the hit to where the window is whole, and the tokens stay exact."""
    hf = build("gemma2", tmp_path, max_position_embeddings=2048)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=32, attention_backend="cpu")
    engine = llm.engine
    cache = engine.prefix_cache
    shared = _long_prompt(160)
    llm.generate([shared + [1, 2]], GREEDY)
    win = next(i for i, g in enumerate(engine.kv_groups.groups) if g.is_windowed)
    tree = cache.trees[win]
    path = tree.walk(shared, 160)
    assert len(path) == 10
    # hollow the windowed group's pages 0..7: a 160-token hit needs only page 9 (positions 145..159)
    for node in path[:8]:
        tree._evict_node(node)
    assert all(n.page == NULL_PAGE for n in path[:8]) and all(n.page != NULL_PAGE for n in path[8:])
    assert engine.num_free_pages() == engine.allocator.num_pages  # the freed pages are free, none leaked
    out = llm.generate([shared + [3, 4]], GREEDY)[0]
    assert out.num_cached_tokens == 160
    assert list(out.token_ids) == hf_greedy_full(hf, shared + [3, 4], GREEDY.max_tokens)
    # now hollow pages 8 and 9 too: every shorter hit's window needs a hollow page, so there is no hit
    for node in tree.walk(shared, 160)[8:]:
        tree._evict_node(node)
    tables, chains = cache.match(shared + [5], 160)
    assert [c.num_pages for c in chains] == [0] * len(chains) and tables == [[]] * len(tables)
    out = llm.generate([shared + [5]], GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert list(out.token_ids) == hf_greedy_full(hf, shared + [5], GREEDY.max_tokens)
    assert engine.num_free_pages() == engine.allocator.num_pages


@pytest.mark.parametrize("overlap", [False, True])
def test_small_pool_under_load_retracts_evicts_and_stays_exact(overlap, tmp_path):
    """Gemma 2 layout in a pool of 32 pages: 8 requests sharing prefixes run together, so the scheduler evicts
    cached pages (leaves of the full tree, any page of the window tree) and retracts; every request's tokens equal
    those of a run in a pool that holds them all without a prefix cache, and no page is held at the end. With overlap
    scheduling, window pages are freed while the previous step is in flight, and only once the cache holds them."""
    build("gemma2", tmp_path, max_position_embeddings=2048)
    base = _long_prompt(300)
    prompts = [base[:120 + 17 * i] + [7 + i] * (i % 3) for i in range(8)]
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=48, attention_backend="cpu")
    ref = LLM(str(tmp_path), disable_radix_cache=True, **kw)  # a pool that holds them all: no eviction, retraction
    want = [list(o.token_ids) for o in ref.generate(prompts, params)]
    assert ref.engine.scheduler.num_retracted_total == 0
    llm = LLM(str(tmp_path), num_pages=32, schedule_conservativeness=0.05,  # admits eagerly: retractions
              enable_overlap_schedule=overlap, **kw)
    assert engine_overlaps(llm) == overlap
    engine = llm.engine
    assert engine.allocator.num_pages == 32
    got = [list(o.token_ids) for o in llm.generate(prompts, params)]
    assert got == want
    assert engine.scheduler.num_retracted_total > 0 and engine.prefix_cache.num_evicted_total > 0
    assert engine.num_free_pages() == engine.allocator.num_pages
    again = llm.generate(prompts[:2], params)  # hits on what the cache kept, still exact
    assert [list(o.token_ids) for o in again] == want[:2]
    assert engine.num_free_pages() == engine.allocator.num_pages
    assert engine.allocator.num_free + engine.pages.num_evictable == engine.allocator.num_pages


def test_prompt_logprobs_request_under_overlap_caches_before_freeing(tmp_path):
    """A prompt-logprobs request skips the cache lookup, so it starts with no place in the trees; under overlap
    scheduling its window pages must still reach the cache before they are freed."""
    hf = build("gemma2", tmp_path, max_position_embeddings=2048)
    prompt = _long_prompt(200)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=32, attention_backend="cpu",
              enable_overlap_schedule=True)
    assert engine_overlaps(llm)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([prompt], params)[0]
    assert list(out.token_ids) == hf_greedy_full(hf, prompt, 8)
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    warm = llm.generate([prompt + [3]], GREEDY)[0]  # its pages were cached in every group
    assert warm.num_cached_tokens == 192
    assert list(warm.token_ids) == hf_greedy_full(hf, prompt + [3], GREEDY.max_tokens)
