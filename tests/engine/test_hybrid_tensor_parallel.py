"""Hybrid-attention families under tensor parallelism on CPU (2 OS processes over gloo): each rank holds half of
the heads (gpt-oss: and half of the sinks; the o_proj bias is added once, after the all-reduce), half of each
expert's width (the down bias added by rank 0 only) or, with expert parallelism, whole experts with their biases;
each rank's layers keep their windows, chunks and NoPE layers. Greedy tokens equal transformers' full-recompute
greedy loop (5 prompts of 40 to 80 tokens x 32 tokens, fp32 KV)."""

from __future__ import annotations

import pytest
from random_models import build, hf_greedy_batch, long_prompt_ids

from pd_cluster.engine import LLM, SamplingParams

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, expert_parallel", [("gpt-oss", False), ("gpt-oss", True), ("gemma3", False),
                                                     ("llama4-multimodal", False)])
def test_tp2_greedy_equals_transformers(family, expert_parallel, tmp_path):
    hf = build(family, tmp_path)
    prompts = long_prompt_ids(5)
    llm = LLM(str(tmp_path), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7,
              enable_expert_parallel=expert_parallel)
    try:
        attn = llm.engine.loaded.model.layers[0].self_attn
        assert attn.num_heads == 4 and attn.num_kv_heads == 1  # rank 0's half of 8 and 2
        if family == "gpt-oss":
            assert tuple(attn.sinks.shape) == (4,)
        outs = llm.generate(prompts, GREEDY_32)
        for ids, out, want in zip(prompts, outs, hf_greedy_batch(hf, prompts, 32)):
            assert list(out.token_ids) == want, (family, len(ids))
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()
