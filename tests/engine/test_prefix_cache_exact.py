"""Acceptance: greedy outputs with the prefix cache equal the outputs without it, token for token.

Nine prompts share prefixes of 0 to 150 tokens (one is identical to another, one
is a prefix of another, one extends another), at ``--chunked-prefill-size 7``,
page sizes 1, 16 and 64, fp32 and FP8 KV: offline (`LLM`) and through
`LLMEngine` in the mixed role with staggered arrivals and an abort; a tiny pool
that must evict; and the prefill role, whose pages (cached ones included) hold
the same bytes as when computed from scratch.
"""

from __future__ import annotations

import argparse
import functools

import pytest
import torch
from engine_reference import PROMPTS, hf_model

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import add_engine_args, config_from_args, config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def shared_prefix_prompts() -> tuple[tuple[int, ...], ...]:
    """Token-id prompts sharing prefixes of several lengths of one long story."""
    _, tok = hf_model()
    base = tok(" ".join(PROMPTS)).input_ids
    tail = [tok(p).input_ids[1:] for p in PROMPTS]  # without the BOS
    prompts = [
        base[:150] + tail[0],
        base[:150] + tail[1],
        base[:70] + tail[2],
        base[:40] + tail[3],
        base[:17] + tail[4],
        base[:150] + tail[0],              # identical to the first: all but its last token is cached
        base[:150],                        # a prefix of the first
        tok(PROMPTS[5]).input_ids,         # nothing shared but the BOS
        base[:150] + tail[0] + tail[6],    # extends the first
    ]
    assert len(base) > 150 and len({tuple(p) for p in prompts}) == 8
    return tuple(tuple(p) for p in prompts)


@functools.lru_cache(maxsize=None)
def cache_off(kv: str, page_size: int) -> tuple[tuple[int, ...], ...]:
    llm = LLM(kv_cache_dtype=kv, page_size=page_size, chunked_prefill_size=7, disable_radix_cache=True)
    assert llm.engine.prefix_cache is None
    outs = llm.generate([list(p) for p in shared_prefix_prompts()], GREEDY)
    assert all(o.num_cached_tokens == 0 for o in outs)
    return tuple(tuple(o.token_ids) for o in outs)


def assert_no_page_in_use(engine: LLMEngine) -> None:
    pages = engine.pages
    assert pages.num_in_use == 0 and engine.num_free_pages() == engine.allocator.num_pages
    assert engine.allocator.num_free + pages.num_evictable == engine.allocator.num_pages
    load = engine.load()  # /get_load: cached pages nobody holds count as free, not as used
    assert load["num_free_pages"] == load["num_total_pages"] and load["token_usage"] == 0
    assert load["num_evictable_pages"] == pages.num_evictable > 0


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_offline_cache_on_equals_off(kv, page_size):
    prompts = [list(p) for p in shared_prefix_prompts()]
    expected = cache_off(kv, page_size)
    # Three running requests at a time: later prompts find the pages of earlier ones.
    llm = LLM(kv_cache_dtype=kv, page_size=page_size, chunked_prefill_size=7, max_running_requests=3)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)  # warm: every shared full page is cached
    assert [tuple(o.token_ids) for o in first] == list(expected)
    assert [tuple(o.token_ids) for o in second] == list(expected)
    full_hit = (len(prompts[0]) - 1) // page_size * page_size
    assert second[0].num_cached_tokens == second[5].num_cached_tokens == full_hit
    assert second[8].num_cached_tokens >= full_hit  # the first prompt's output pages are cached too
    assert all(o.num_cached_tokens % page_size == 0 for o in first + second)
    st = llm.engine.stats
    assert st.prefix_cache_queries == 2 * sum(map(len, prompts))
    assert st.prefix_cache_hits == sum(o.num_cached_tokens for o in first + second) > 0
    assert_no_page_in_use(llm.engine)


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3"])
def test_engine_mixed_role_staggered_arrivals_and_abort(kv, caplog):
    prompts = shared_prefix_prompts()
    expected = cache_off(kv, 16)
    engine = LLMEngine(config_from_kwargs(role="mixed", kv_cache_dtype=kv, page_size=16, chunked_prefill_size=7))
    arrivals = {4 * i: i for i in range(len(prompts))}
    arrivals[1] = "doomed"  # shares 150 tokens with prompt 0; aborted mid-prefill
    done: dict[str, tuple[list[int], int]] = {}
    with caplog.at_level("INFO", logger="engine"):
        for step in range(2000):
            if step in arrivals:
                i = arrivals[step]
                engine.add_request(str(i), list(prompts[0 if i == "doomed" else i]), GREEDY, stream=i == 3)
            if step == 9:
                assert engine.abort_request("doomed")
            for d in engine.step().deltas:
                if d.finished:
                    req_tokens = done.get(d.request_id, ([], 0))[0]
                    done[d.request_id] = (req_tokens + d.new_token_ids, d.num_cached_tokens)
                elif d.new_token_ids:
                    done.setdefault(d.request_id, ([], 0))[0].extend(d.new_token_ids)
            if not engine.has_work() and step > max(a for a in arrivals):
                break
    assert {k: tuple(v[0]) for k, v in done.items() if k != "doomed"} == \
        {str(i): expected[i] for i in range(len(prompts))}
    # Found the pages the earlier requests had computed by then (a page joins the cache once full):
    assert done["1"][1] >= 16 and done["5"][1] >= 112 and done["8"][1] >= 160
    assert done["6"][1] == 144  # all 9 full pages of a 150-token prompt
    assert engine.stats.prefix_cache_hits > 0
    assert any("#cached-token: 144," in m for m in caplog.messages)
    assert not engine.requests
    assert_no_page_in_use(engine)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_cache_on_equals_off():
    # Page ids are rank 0's: every rank's pool reuses the same cached pages for its share of the heads.
    prompts = [list(p) for p in shared_prefix_prompts()]
    llm = LLM(tp_size=2, kv_cache_dtype="fp8_e4m3", page_size=16, chunked_prefill_size=7, max_running_requests=3)
    try:
        outs = llm.generate(prompts, GREEDY) + llm.generate(prompts, GREEDY)
        assert [tuple(o.token_ids) for o in outs] == 2 * list(cache_off("fp8_e4m3", 16))
        assert llm.engine.stats.prefix_cache_hits > 0
        assert_no_page_in_use(llm.engine)
    finally:
        llm.engine.close()


def test_tiny_pool_evicts_and_retracts_and_stays_exact():
    # 24 pages of 16 tokens: one 200-token request and its output nearly fill the pool, so finished
    # requests' cached pages must be evicted for the next ones, and overcommitted admission retracts.
    prompts = [list(p) for p in shared_prefix_prompts()]
    expected = cache_off("fp32", 16)
    llm = LLM(page_size=16, num_pages=24, chunked_prefill_size=7, schedule_conservativeness=0.1)
    outs = llm.generate(prompts, GREEDY)
    outs += llm.generate(prompts[::-1], GREEDY)
    assert [tuple(o.token_ids) for o in outs] == list(expected) + list(expected[::-1])
    engine = llm.engine
    assert engine.prefix_cache.num_evicted_total > 0 and engine.stats.prefix_cache_hits > 0
    assert engine.scheduler.num_retracted_total > 0
    assert_no_page_in_use(engine)


def test_prefill_role_computes_only_the_suffix_and_cached_pages_hold_the_same_bytes():
    prompts = shared_prefix_prompts()
    a, b = list(prompts[0]), list(prompts[1])  # share 150 tokens: 9 full pages of 16
    one = SamplingParams(max_tokens=8, temperature=0.0)

    def run(engine: LLMEngine, rid: str, prompt: list[int]):
        engine.add_request(rid, prompt, one)
        progress, first = [], None
        while engine.has_work():
            out = engine.step()
            progress += [p for p in out.prefill_progress if p.request_id == rid]
            first = next((d.new_token_ids[0] for d in out.deltas if d.request_id == rid and d.new_token_ids), first)
        pages = list(engine.requests[rid].block_table)  # held for the push
        content = engine.pool.kv[torch.tensor(pages)].clone()
        assert engine.release_request(rid)
        return progress, first, pages, content

    kw = dict(role="prefill", kv_cache_dtype="fp8_e4m3", page_size=16, chunked_prefill_size=16)
    on = LLMEngine(config_from_kwargs(**kw))
    off = LLMEngine(config_from_kwargs(disable_radix_cache=True, **kw))
    _, _, pages_a, _ = run(on, "a", a)
    prog, first, pages_b, content = run(on, "b", b)
    _, first_off, _, content_off = run(off, "b", b)
    assert prog[0].start == 144 and prog[-1].done and prog[-1].end == len(b)  # only the suffix was computed
    assert pages_b[:9] == pages_a[:9] and prog[0].block_table[:9] == pages_a[:9]  # what the push reads
    assert first == first_off
    assert torch.equal(content, content_off)  # the FP8 bytes decode receives are those of a recomputation
    assert on.stats.prefix_cache_hits == 144 and on.scheduler.held == {}
    assert_no_page_in_use(on)


def test_flags_turn_the_cache_off_in_every_role():
    parser = add_engine_args(argparse.ArgumentParser())
    for argv, on in (([], True), (["--disable-radix-cache"], False), (["--no-enable-prefix-caching"], False)):
        assert config_from_args(parser.parse_args(argv)).cache.enable_prefix_caching is on
    for kw in ({"disable_radix_cache": True},):
        assert LLM(**kw).engine.prefix_cache is None
    assert LLM().engine.prefix_cache is not None
    assert LLMEngine(config_from_kwargs(role="decode")).prefix_cache is not None  # decode keeps finished pages
    assert LLMEngine(config_from_kwargs(role="decode", disable_radix_cache=True)).prefix_cache is None
