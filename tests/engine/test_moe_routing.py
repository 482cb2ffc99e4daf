"""Each family's MoE routing and block equal transformers' own modules (5.24), on random inputs.

The routers are compared on the chosen experts (as sets: transformers' DeepSeek routers take an unsorted
top-k) and on each chosen expert's weight; the whole block (router, experts, shared experts) on its output.
DeepSeek-V2/V3 are checked here at the block level: their attention (MLA) is another module's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe, DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from pd_cluster.engine.model.families import moe_from_hf
from pd_cluster.engine.model.moe import Router, SparseMoE, select_experts
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig

H, T = 32, 64
SHAPE = dict(hidden_size=H, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, vocab_size=64)
CASES = {
    "mixtral": ("MixtralForCausalLM", MixtralConfig, MixtralTopKRouter, MixtralSparseMoeBlock,
                dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3-moe-norm": ("Qwen3MoeForCausalLM", Qwen3MoeConfig, Qwen3MoeTopKRouter, Qwen3MoeSparseMoeBlock,
                       dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True)),
    "qwen3-moe-raw": ("Qwen3MoeForCausalLM", Qwen3MoeConfig, Qwen3MoeTopKRouter, Qwen3MoeSparseMoeBlock,
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False)),
    "deepseek-v2-greedy": ("DeepseekV2ForCausalLM", DeepseekV2Config, DeepseekV2TopkRouter, DeepseekV2Moe,
                           dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.5)),
    "deepseek-v2-group-limited": ("DeepseekV2ForCausalLM", DeepseekV2Config, DeepseekV2TopkRouter, DeepseekV2Moe,
                                  dict(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=16,
                                       n_shared_experts=1, topk_method="group_limited_greedy", n_group=4,
                                       topk_group=2, routed_scaling_factor=2.0)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", DeepseekV3Config, DeepseekV3TopkRouter, DeepseekV3MoE,
                    dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, n_shared_experts=1,
                         n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                         first_k_dense_replace=1)),
    "kimi-k2-shape": ("DeepseekV3ForCausalLM", DeepseekV3Config, DeepseekV3TopkRouter, DeepseekV3MoE,
                      dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, n_shared_experts=1,
                           n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
                           first_k_dense_replace=1)),
}


def _hf_config(case: str):
    arch, cfg_cls, _, _, extra = CASES[case]
    cfg = cfg_cls(**SHAPE, **extra)
    return arch, cfg, {**cfg.to_dict(), **extra, "architectures": [arch]}


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0))
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:  # DeepSeek-V3's balancing bias: comparable to the scores
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_router_equals_transformers(case):
    arch, hf_cfg, cfg_dict = _hf_config(case)
    moe = moe_from_hf(cfg_dict, arch)
    gen = torch.Generator().manual_seed(3)
    hf = CASES[case][2](hf_cfg)
    _randomise(hf, gen)
    ours = Router(H, moe.routing)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(T, H, generator=gen)
    with torch.no_grad():
        _, hf_w, hf_ids = hf(x)
        w, ids = ours(x)
    ref, got = _by_expert(hf_w.float(), hf_ids), _by_expert(w, ids)
    for r, g in zip(ref, got):
        assert r.keys() == g.keys()
        assert all(abs(r[e] - g[e]) <= 1e-6 * max(1.0, abs(r[e])) for e in r)
    if moe.routing.n_group > 1:  # the group limit really removes experts some token would otherwise take
        free = RoutingConfig(moe.num_experts, moe.top_k, moe.routing.scoring,
                             e_score_correction_bias=moe.routing.e_score_correction_bias)
        logits = torch.nn.functional.linear(x, ours.weight)
        _, free_ids = select_experts(logits, free, ours.e_score_correction_bias)
        assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(free_ids, ids))


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_block_equals_transformers(case):
    arch, hf_cfg, cfg_dict = _hf_config(case)
    moe = moe_from_hf(cfg_dict, arch)
    gen = torch.Generator().manual_seed(5)
    hf = CASES[case][3](hf_cfg).eval()
    _randomise(hf, gen)
    ours = SparseMoE(H, moe)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        if ours.gate.e_score_correction_bias is not None:
            ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.experts.w13_weight.copy_(hf.experts.gate_up_proj)  # [E, 2I, H], gate rows first
        ours.experts.w2_weight.copy_(hf.experts.down_proj)
        if ours.shared_experts is not None:
            s = hf.shared_experts
            ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            ours.shared_experts.down_proj.weight.copy_(s.down_proj.weight)
    x = torch.randn(1, T, H, generator=gen)
    with torch.no_grad():
        ref = hf(x)[0]
        out = ours(x[0])
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), (out - ref).abs().max()


def test_moe_layers_follow_each_familys_rule():
    qwen = {"num_hidden_layers": 6, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}
    assert moe_from_hf(qwen, "Qwen3MoeForCausalLM").moe_layers == (1, 5)  # (i + 1) % 2 == 0, 3 excluded
    ds = {"num_hidden_layers": 6, "n_routed_experts": 4, "moe_intermediate_size": 8, "first_k_dense_replace": 2,
          "n_shared_experts": 2}
    v3 = moe_from_hf(ds, "DeepseekV3ForCausalLM")
    assert v3.moe_layers == (2, 3, 4, 5) and v3.shared_intermediate_size == 16
    assert v3.routing.scoring == "sigmoid" and v3.routing.e_score_correction_bias
    assert moe_from_hf({**ds, "moe_layer_freq": 2}, "DeepseekV2ForCausalLM").moe_layers == (2, 4)
    assert moe_from_hf({"num_hidden_layers": 2, "num_experts": 0}, "Qwen3MoeForCausalLM") is None


@pytest.mark.parametrize("cfg, match", [
    ({"topk_method": "noaux_tc", "scoring_func": "softmax"}, "noaux_tc"),
    ({"topk_method": "some_new_method"}, "topk_method"),
    ({"scoring_func": "sqrtsoftplus", "topk_method": "greedy"}, "scoring_func"),
    ({"n_group": 3, "topk_method": "group_limited_greedy"}, "n_group"),
])
def test_unimplemented_routing_is_refused_by_name(cfg, match):
    base = {"num_hidden_layers": 2, "n_routed_experts": 8, "moe_intermediate_size": 8, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match=match):
        moe_from_hf({**base, **cfg}, "DeepseekV2ForCausalLM")


def test_later_families_fit_the_routing_config():
    """gpt-oss (top-k on logits, softmax over the k, router bias) and Llama 4 (top-1, sigmoid, weight on the
    input) are settings of the same record; their math is checked against a direct computation."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 8, generator=gen)
    gpt_oss = RoutingConfig(8, 4, "softmax", score_before_topk=False, router_bias=True)
    w, ids = select_experts(logits, gpt_oss)
    top, top_ids = logits.topk(4, dim=-1)
    assert torch.equal(ids, top_ids) and torch.allclose(w, top.softmax(-1))
    llama4 = RoutingConfig(8, 1, "sigmoid", score_before_topk=False, apply_weights_on_input=True)
    w, ids = select_experts(logits, llama4)
    assert torch.equal(ids[:, 0], logits.argmax(-1)) and torch.allclose(w[:, 0], logits.max(-1).values.sigmoid())
    with pytest.raises(ValueError, match="top-1"):
        RoutingConfig(8, 2, "sigmoid", score_before_topk=False, apply_weights_on_input=True)
    with pytest.raises(ValueError, match="activation"):
        MoEConfig(8, 16, gpt_oss, (0,), activation="swiglu_oai")
