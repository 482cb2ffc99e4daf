"""Acceptance: tiny random Mixtral, Qwen3-MoE and Phi-3 checkpoints (and the dense Llama, Qwen2, Qwen3 and
Mistral ones), written by transformers (`save_pretrained`: the real tensor names, sharded), generate
transformers' own greedy tokens.

The reference is a full-recompute greedy loop (`hf_greedy_batch`): each token is the argmax of a fresh
forward pass over the whole sequence. 5 prompts x 32 tokens, fp32 KV, chunked prefill of 7 tokens over
16-token pages, so prompts span several chunks and pages.
"""

from __future__ import annotations

import pytest
import torch
from random_models import build, hf_greedy_batch, prompt_ids

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.layers import MLP
from pd_cluster.engine.model.moe import SparseMoE

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# family -> the layers whose MLP is a MoE block (3 layers each; see random_models.FAMILIES)
LAYOUT = {"mixtral": (0, 1, 2), "qwen3-moe": (0, 2), "qwen3-moe-sparse-step": (1,), "phi3": (),
          # the dense families stay exact the same way
          "llama-gqa4": (), "llama3-rope-scaling": (), "qwen2-bias-tied": (), "qwen2-yarn": (), "qwen3-qknorm": (),
          "mistral": (), "mistral-window": ()}


@pytest.mark.parametrize("family", sorted(LAYOUT))
def test_greedy_equals_transformers_full_recompute(family, tmp_path):
    hf = build(family, tmp_path)
    prompts = prompt_ids(5)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    layers = llm.engine.loaded.model.layers
    assert tuple(i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)) == LAYOUT[family]
    assert all(isinstance(layer.mlp, MLP) for i, layer in enumerate(layers) if i not in LAYOUT[family])
    outs = llm.generate(prompts, GREEDY_32)
    for ids, out, want in zip(prompts, outs, hf_greedy_batch(hf, prompts, 32)):
        assert list(out.token_ids) == want, ids
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
