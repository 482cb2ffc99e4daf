"""Acceptance: each family added as one file of `engine/model/families/` (Gemma 3's and Mistral 3's multimodal
classes, Ministral, Qwen2-MoE, OLMo 2, Granite, GLM-4, GLM-4-MoE, Cohere, SmolLM3, StarCoder2, EXAONE 4,
Phi-3.5-MoE) generates transformers' own greedy tokens from a tiny random checkpoint written by transformers
(`save_pretrained`: the real tensor names), and its logits equal transformers' (which greedy tokens alone do not
show for logit scales, soft caps and biases).

The reference is a full-recompute greedy loop (`hf_greedy_full`). 5 prompts x 32 tokens, fp32 KV, chunked
prefill of 7 tokens over 16-token pages. What each checkpoint exercises is in `family_models.NEW_FAMILIES`.
"""

from __future__ import annotations

import pytest
import torch
from family_models import NEW_FAMILIES
from random_models import build, engine_logits, hf_greedy_full, hf_logits, long_prompt_ids, prompt_ids

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.moe import SparseMoE

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# families with windows of 16 tokens get prompts of 40 to 80 tokens (past the windows)
WINDOWED = ("gemma3-multimodal", "mistral3-multimodal", "ministral", "starcoder2", "exaone4")


def _layout(arch) -> dict:
    return dict(kinds=[a.kind for a in arch.layer_attention], rope=[a.rope for a in arch.layer_attention],
                moe=[arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)])


# what the engine read: each layer's attention kind, RoPE or NoPE, and MoE or dense
LAYOUT = {
    "gemma3-multimodal": dict(kinds=["sliding"] * 5 + ["full"], rope=[True] * 6, moe=[False] * 6),
    "ministral": dict(kinds=["sliding", "full", "sliding"], rope=[True] * 3, moe=[False] * 3),
    "qwen2-moe": dict(kinds=["full"] * 3, rope=[True] * 3, moe=[True, False, True]),
    "glm4-moe": dict(kinds=["full"] * 3, rope=[True] * 3, moe=[False, True, True]),
    "smollm3": dict(kinds=["full"] * 3, rope=[True, False, True], moe=[False] * 3),
    "exaone4": dict(kinds=["sliding"] * 3 + ["full"], rope=[True] * 3 + [False], moe=[False] * 4),
    "phimoe": dict(kinds=["full"] * 3, rope=[True] * 3, moe=[True] * 3),
}


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_greedy_and_logits_equal_transformers(family, tmp_path):
    hf = build(family, tmp_path)
    prompts = long_prompt_ids(5) if family in WINDOWED else prompt_ids(5)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    if family in LAYOUT:
        assert _layout(llm.engine.loaded.arch) == LAYOUT[family]
    layers = llm.engine.loaded.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == \
        [llm.engine.loaded.arch.is_moe_layer(i) for i in range(len(layers))]
    outs = llm.generate(prompts, GREEDY_32)
    for ids, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy_full(hf, ids, 32), ids
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    ids = prompts[0]
    with torch.no_grad():
        want = hf_logits(hf, ids).float()
    got = engine_logits(tmp_path, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), \
        (got - want).abs().max().item()
