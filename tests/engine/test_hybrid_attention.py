"""Acceptance: hybrid attention, exact against transformers. Tiny random Gemma 2, Gemma 3, gpt-oss, Llama 4
(text, and the language model of a Llama4ForConditionalGeneration checkpoint), Qwen2 with ``max_window_layers``
and Mistral with a 16-token window, written by transformers (`save_pretrained`: the real tensor names), generate
transformers' own greedy tokens.

Every layer type appears (sliding windows and chunks of 16 tokens, full and NoPE layers); prompts are 40 to 80
tokens, so each crosses several windows and chunks. 5 prompts x 32 tokens, fp32 KV, chunked prefill of 7 tokens
over 16-token pages, through the CPU backend (the compiled kernel: every query row starts at its first visible
key) and the torch reference (query blocks that read only the keys they see). The reference is transformers'
full-recompute greedy loop (`hf_greedy_batch`: the prompts side by side, one pass per token).
"""

from __future__ import annotations

import pytest
from random_models import HYBRID_FAMILIES, build, hf_greedy_batch, long_prompt_ids

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.moe import SparseMoE

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# family -> each layer's (kind, window or chunk), and its layers whose MLP is a MoE block
LAYOUT = {
    "gemma2": ([("sliding", 16), ("full", 0)] * 2, ()),
    "gemma3": ([("sliding", 16)] * 5 + [("full", 0)], ()),
    "gpt-oss": ([("sliding", 16), ("full", 0)] * 2, (0, 1, 2, 3)),
    "llama4": ([("chunked", 16), ("full", 0)] * 2, (1, 3)),
    "llama4-multimodal": ([("chunked", 16), ("full", 0)] * 2, (1, 3)),
    "qwen2-window-layers": ([("full", 0), ("sliding", 16), ("sliding", 16)], ()),
    "mistral-window16": ([("sliding", 16)] * 3, ()),
}


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def family_model(request, tmp_path_factory):
    """(family, folder, transformers' greedy tokens for `long_prompt_ids(5)`)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, folder)
    prompts = long_prompt_ids(5)
    return request.param, folder, prompts, hf_greedy_batch(hf, prompts, 32)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_equals_transformers_full_recompute(family_model, backend):
    family, folder, prompts, expected = family_model
    llm = LLM(str(folder), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7, attention_backend=backend)
    arch = llm.engine.loaded.arch
    kinds, moe_layers = LAYOUT[family]
    assert [a.mask_key for a in arch.layer_attention] == kinds
    layers = llm.engine.loaded.model.layers
    assert tuple(i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)) == moe_layers
    outs = llm.generate(prompts, GREEDY_32)
    for ids, out, want in zip(prompts, outs, expected):
        assert list(out.token_ids) == want, (family, len(ids))
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages


def test_the_windows_and_chunks_change_the_tokens(family_model):
    """The comparison above can fail: with every layer attending to the whole context (windows and chunks
    ignored, as an engine without per-layer types would), the same engine leaves transformers' tokens."""
    import dataclasses

    from pd_cluster.engine.layer_attention import LayerAttention

    family, folder, prompts, expected = family_model
    llm = LLM(str(folder), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7, attention_backend="cpu")
    backend = llm.engine.backend
    backend.layers = tuple(dataclasses.replace(a, kind="full", window=None, chunk_size=None)
                           if a.kind != "full" else a for a in backend.layers)
    assert all(isinstance(a, LayerAttention) and a.kind == "full" for a in backend.layers)
    outs = llm.generate(prompts, GREEDY_32)
    assert sum(list(o.token_ids) != want for o, want in zip(outs, expected)) >= 3, family
