"""Mixtral, Qwen3-MoE and Phi-3 under tensor parallelism on CPU (2 OS processes over gloo): each expert's
intermediate width split across the ranks (vLLM's default), or whole experts per rank with
``enable_expert_parallel``; Phi-3's pre-fused qkv/gate-up tensors split per part. Greedy tokens equal
transformers' full-recompute greedy loop (5 prompts x 32 tokens, fp32 KV)."""

from __future__ import annotations

import pytest
from random_models import build, hf_greedy_batch, prompt_ids

from pd_cluster.engine import LLM, SamplingParams

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, expert_parallel", [("mixtral", False), ("qwen3-moe", False), ("qwen3-moe", True),
                                                     ("phi3", False)])
def test_tp2_greedy_equals_transformers(family, expert_parallel, tmp_path):
    hf = build(family, tmp_path)
    prompts = prompt_ids(5)
    llm = LLM(str(tmp_path), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7,
              enable_expert_parallel=expert_parallel)
    try:
        mlp = llm.engine.loaded.model.layers[0].mlp
        if family != "phi3":  # rank 0's share of the 4 experts of width 32
            shape = (2, 64, 64) if expert_parallel else (4, 32, 64)
            assert tuple(mlp.experts.w13_weight.shape) == shape
        else:
            assert mlp.gate_up_proj.weight.shape[0] == 128  # 2 x 128 / 2
        outs = llm.generate(prompts, GREEDY_32)
        for ids, out, want in zip(prompts, outs, hf_greedy_batch(hf, prompts, 32)):
            assert list(out.token_ids) == want, ids
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()


def test_each_split_needs_the_tp_size_to_divide_what_it_splits():
    from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig, check_moe_parallel

    moe = MoEConfig(6, 32, RoutingConfig(6, 2), (0,))
    check_moe_parallel(moe, 4, expert_parallel=False)  # 32 / 4
    with pytest.raises(ValueError, match="number of experts"):
        check_moe_parallel(moe, 4, expert_parallel=True)  # 6 / 4
    check_moe_parallel(moe, 3, expert_parallel=True)
    with pytest.raises(ValueError, match="experts' intermediate size"):
        check_moe_parallel(moe, 3, expert_parallel=False)
