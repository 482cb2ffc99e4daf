"""Tensor parallelism on CPU (gloo): N OS processes, each with 1/N of the heads and MLP width, give the
same greedy tokens as transformers."""

from __future__ import annotations

import pytest
from engine_reference import PROMPTS, hf_greedy

from pd_cluster.engine import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp_size, kv", [(2, "fp32"), (4, "fp8_e4m3")])
def test_tp_greedy_equals_transformers(tp_size, kv):
    llm = LLM(tp_size=tp_size, page_size=16, kv_cache_dtype=kv, chunked_prefill_size=7)
    try:
        engine = llm.engine
        assert engine.pool.layout.num_kv_heads == 4 // tp_size and engine.pool.layout.tp_size == tp_size
        assert engine.loaded.model.layers[0].mlp.intermediate_size == 172 // tp_size
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs):
            assert tuple(out.token_ids) == hf_greedy(prompt, 64, kv), prompt
        assert engine.num_free_pages() == engine.allocator.num_pages
        ranks = engine.tp_driver.call("ping", gather=True)
        assert ranks == list(range(tp_size))
    finally:
        llm.engine.close()
    assert llm.engine.tp_driver is None


def test_tp_size_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match="must divide num_key_value_heads"):
        LLM(tp_size=3)
