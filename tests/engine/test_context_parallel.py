"""Context-parallel prefill (``--prefill-context-parallel-size``): the zig-zag split, start-up refusals naming
the flag, and greedy tokens at CP 2 (two rank processes over gloo) equal to CP 1's and to transformers' on tiny
random checkpoints, with prompts longer than the chunked-prefill size (and than Gemma 3's window)."""

from __future__ import annotations

import pytest
from random_models import build, hf_greedy_full, long_prompt_ids
from transformers import AutoModelForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.executor.context_parallel_checks import check_context_parallel
from pd_cluster.engine.parallel.context_parallel import rank_pieces, zigzag_pieces

LLAMA3 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = (40, 53, 71, 80)  # every prompt longer than the 24-token chunk; 53 leaves a 5-token last chunk


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    path = tmp_path_factory.mktemp("cp") / "llama3"
    build("llama3-rope-scaling", path, **LLAMA3)
    return path


@pytest.mark.parametrize("n", [4, 5, 24, 53, 1000, 16384])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_zigzag_pieces_cover_the_chunk_and_balance_causal_work(n, size):
    pieces = zigzag_pieces(n, size)
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert max(hi - lo for lo, hi in pieces) - min(hi - lo for lo, hi in pieces) <= 1
    # causal work of a rank: sum over its query positions of the keys each sees (position + 1)
    work = [sum(sum(range(lo + 1, hi + 1)) for lo, hi in rank_pieces(n, size, r)) for r in range(size)]
    assert max(work) - min(work) <= (n // (2 * size) + 1) * 2 * size  # equal up to one row per piece boundary
    assert rank_pieces(n, size, 0)[1][1] == n  # the chunk's last token (its logits) is rank 0's


def test_the_flag_and_its_short_name_parse():
    import argparse

    from pd_cluster.engine.args import add_engine_args, config_from_args

    parser = add_engine_args(argparse.ArgumentParser())
    for argv in (["--prefill-context-parallel-size", "2"], ["-pcp", "2"]):
        parallel = config_from_args(parser.parse_args(argv)).parallel
        assert parallel.prefill_context_parallel_size == 2 and parallel.world_size == 2


def test_context_parallel_with_dp_attention_is_refused_naming_both_flags():
    from pd_cluster.engine.config import ParallelConfig

    with pytest.raises(ValueError, match="--prefill-context-parallel-size with --enable-dp-attention"):
        ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True, prefill_context_parallel_size=2)


def _refusal(path, **kw) -> str:
    with pytest.raises(ValueError) as e:
        check_context_parallel(config_from_kwargs(model=str(path), **kw))
    assert "--prefill-context-parallel-size" in str(e.value)
    return str(e.value)


def test_refusals_name_the_flag_before_any_rank_starts(llama3, tmp_path):
    with pytest.raises(ValueError, match="--prefill-context-parallel-size must be at least 1"):
        config_from_kwargs(model=str(llama3), prefill_context_parallel_size=0)
    assert "--tp-size 2" in _refusal(llama3, prefill_context_parallel_size=2, tp_size=2)
    assert "--role decode" in _refusal(llama3, prefill_context_parallel_size=2, role="decode")
    assert "NGRAM" in _refusal(llama3, prefill_context_parallel_size=2, speculative_algorithm="NGRAM")
    assert "--enable-hierarchical-cache" in _refusal(llama3, prefill_context_parallel_size=2,
                                                     enable_hierarchical_cache=True)
    assert "--chunked-prefill-size of at least 6" in _refusal(llama3, prefill_context_parallel_size=3,
                                                              chunked_prefill_size=5)
    build("gemma3", tmp_path / "gemma3")
    assert "--disable-hybrid-kv-cache-manager" in _refusal(tmp_path / "gemma3", prefill_context_parallel_size=2)
    check_context_parallel(config_from_kwargs(model=str(tmp_path / "gemma3"), prefill_context_parallel_size=2,
                                              disable_hybrid_kv_cache_manager=True))
    check_context_parallel(config_from_kwargs(model=str(llama3), prefill_context_parallel_size=2))
    check_context_parallel(config_from_kwargs(model=str(llama3), prefill_context_parallel_size=2, role="prefill"))


def _greedy_each(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One prompt per `generate` call: every prefill chunk is a one-request step, split over the CP ranks."""
    return [list(llm.generate([ids], GREEDY)[0].token_ids) for ids in prompts]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_greedy_equals_cp1_and_transformers_llama3(llama3):
    prompts = long_prompt_ids(4, lengths=LENGTHS)
    hf = AutoModelForCausalLM.from_pretrained(llama3).eval()
    expected = [hf_greedy_full(hf, ids, GREEDY.max_tokens) for ids in prompts]
    args = dict(kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=24)
    one = LLM(str(llama3), **args)
    try:
        assert _greedy_each(one, prompts) == expected
    finally:
        one.engine.close()
    llm = LLM(str(llama3), prefill_context_parallel_size=2, **args)
    try:
        cp = llm.engine.shard.cp
        assert _greedy_each(llm, prompts) == expected
        assert cp.split_steps == sum(-(-n // 24) for n in LENGTHS)  # every chunk ran split
        # all four at once: mixed prefill/decode steps run whole on every rank, same tokens
        assert [list(o.token_ids) for o in llm.generate(prompts, GREEDY)] == expected
        # the same prompt again: a prefix-cache hit, the rest prefilled split over the cached pages
        before = cp.split_steps
        assert _greedy_each(llm, prompts[3:]) == expected[3:]
        assert cp.split_steps > before
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_greedy_equals_transformers_gemma3_past_the_window(tmp_path):
    """Gemma 3's sliding-window layers (16 tokens) with one KV group: prompts of 40 to 80 tokens, chunks of 24."""
    build("gemma3", tmp_path / "gemma3")
    prompts = long_prompt_ids(4, lengths=LENGTHS)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "gemma3").eval()
    expected = [hf_greedy_full(hf, ids, GREEDY.max_tokens) for ids in prompts]
    llm = LLM(str(tmp_path / "gemma3"), prefill_context_parallel_size=2, disable_hybrid_kv_cache_manager=True,
              kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=24)
    try:
        assert _greedy_each(llm, prompts) == expected
        assert llm.engine.shard.cp.split_steps == sum(-(-n // 24) for n in LENGTHS)
    finally:
        llm.engine.close()
