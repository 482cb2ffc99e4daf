"""Longrope as transformers applies it, per request: a Phi-4-mini-shaped tiny checkpoint (written by transformers;
``original_max_position_embeddings`` 64) gives transformers' full-recompute greedy tokens for prompts below 64
tokens that stay below (the short factors), prompts above (the long factors), and a prompt below whose output
grows past 64 tokens (transformers rotates the whole sequence by the long factors from then on; the engine
recomputes that request's KV with them), all in one batch; the prefix cache never serves pages rotated one way
to a request rotated the other."""

from __future__ import annotations

from random_models import build, hf_greedy_full, prompt_ids

from pd_cluster.engine import LLM, SamplingParams

L0 = 64  # original_max_position_embeddings of "phi4-mini-longrope"


def _prompt(i: int, n: int) -> list[int]:
    ids = prompt_ids(5)[i % 5]
    return (ids * (n // len(ids) + 1))[:n]


def test_short_long_and_crossing_requests_equal_transformers(tmp_path):
    hf = build("phi4-mini-longrope", tmp_path)
    prompts = [_prompt(0, 20), _prompt(1, 25), _prompt(2, 70), _prompt(3, 90), _prompt(4, 40)]
    assert [len(p) + 32 > L0 for p in prompts] == [False, False, True, True, True] and len(prompts[4]) < L0
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy_full(hf, ids, 32), len(ids)
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages


def test_the_prefix_cache_keeps_the_two_factor_sets_apart(tmp_path):
    hf = build("phi4-mini-longrope", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    short = _prompt(0, 50)  # 50 + 8 tokens: the short factors; 3 full pages cached
    long = short[:48] + _prompt(1, 30)  # the same 3 pages, then past 64: the long factors
    first = llm.generate([short], greedy)[0]
    assert list(first.token_ids) == hf_greedy_full(hf, short, 8)
    again = llm.generate([short], greedy)[0]
    assert again.num_cached_tokens == 48 and list(again.token_ids) == list(first.token_ids)
    out = llm.generate([long], greedy)[0]
    assert out.num_cached_tokens == 0  # the short pages hold keys rotated the other way
    assert list(out.token_ids) == hf_greedy_full(hf, long, 8)
    out = llm.generate([long], greedy)[0]
    assert out.num_cached_tokens == 64 and list(out.token_ids) == hf_greedy_full(hf, long, 8)
