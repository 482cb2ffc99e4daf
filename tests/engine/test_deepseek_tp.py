"""Tensor parallelism on CPU (gloo) for multi-head latent attention: 2 OS processes, each with half the heads
and of the MLP width and the whole latent, give transformers' greedy tokens; the latent pages of both ranks
hold the same bytes (every rank computes and caches the full latent, as vLLM and SGLang do)."""

from __future__ import annotations

import pytest
from deepseek_models import FAMILIES, PROMPTS, build, hf_greedy_recompute, prompt_ids

from pd_cluster.engine import LLM, SamplingParams


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
        assert engine.loaded.model.layers[0].self_attn.num_heads == 2  # 4 heads split over 2 ranks
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
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
