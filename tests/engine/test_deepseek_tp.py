"""Tensor parallelism on CPU (gloo) for DeepSeek-V2/V3: 2 OS processes, each with half the attention heads, half
of the dense MLP's width, half of every expert's width (or, with expert parallelism, half of the experts whole)
and the whole latent, give transformers' greedy tokens; the latent pages of both ranks hold the same bytes (every
rank computes and caches the full latent, as vLLM and SGLang do)."""

from __future__ import annotations

import pytest
from deepseek_models import FAMILIES, PROMPTS, build, hf_greedy_recompute, prompt_ids

from pd_cluster.engine import LLM, SamplingParams

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_greedy_equals_transformers_and_ranks_hold_the_same_latents(family, tmp_path):
    hf = build(family, tmp_path)
    refs = [hf_greedy_recompute(hf, prompt_ids(p), 32) for p in PROMPTS]
    llm = LLM(str(tmp_path), tp_size=2, page_size=16, kv_cache_dtype="fp32", chunked_prefill_size=7)
    try:
        engine = llm.engine
        lay = engine.pool.layout
        assert (lay.kv_format, lay.num_kv_heads, lay.tp_size) == ("mla", 1, 2)
        model = engine.loaded.model
        assert model.layers[0].self_attn.num_heads == 2  # 4 heads split over 2 ranks
        assert model.layers[0].mlp.gate_up_proj.weight.shape[0] == 128  # the dense layer: 2 x 128 / 2
        experts = model.layers[1].mlp.experts  # a MoE layer: all 4 experts, each 32 wide, half of it here
        assert tuple(experts.w13_weight.shape) == (4, 32, 64)
        outs = llm.generate(PROMPTS, GREEDY_32)
        for prompt, out, ref in zip(PROMPTS, outs, refs):
            assert out.token_ids == ref, prompt
        driver = engine.tp_driver
        driver.call("install", "latents", "deepseek_models:LatentDigest", gather=True)
        pages = list(range(1, engine.pool.num_pages + 1))
        digests = driver.call("ext", "latents", "digest", pages, gather=True)
        assert digests[0] == digests[1]
        assert engine.pool.kv[1:].abs().sum() > 0  # the pages were written (and are cached, not zeros)
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_expert_parallel_where_tp_alone_cannot_split_the_experts(tmp_path):
    """DeepSeek-V2 with experts 33 wide: TP 2 cannot split them, and says so before any rank starts; with
    ``enable_expert_parallel`` each rank holds 2 of the 4 experts whole (the two shared experts, 66 wide, are
    still split) and the tokens are transformers'."""
    hf = build("deepseek-v2", tmp_path, moe_intermediate_size=33)
    hf.set_experts_implementation("eager")  # its default grouped GEMM needs rows of a multiple of 16 bytes
    refs = [hf_greedy_recompute(hf, prompt_ids(p), 32) for p in PROMPTS]
    with pytest.raises(ValueError, match=r"--tp-size 2 must divide the experts' intermediate size \(33\)"):
        LLM(str(tmp_path), tp_size=2)
    llm = LLM(str(tmp_path), tp_size=2, page_size=16, kv_cache_dtype="fp32", chunked_prefill_size=7,
              enable_expert_parallel=True)
    try:
        moe = llm.engine.loaded.model.layers[1].mlp
        assert (moe.experts.num_local_experts, moe.experts.first_expert) == (2, 0)  # rank 0: experts 0 and 1
        assert tuple(moe.experts.w13_weight.shape) == (2, 66, 64)
        assert moe.shared_experts.gate_up_proj.weight.shape[0] == 66  # 2 x 66 / 2
        outs = llm.generate(PROMPTS, GREEDY_32)
        for prompt, out, ref in zip(PROMPTS, outs, refs):
            assert out.token_ids == ref, prompt
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()
