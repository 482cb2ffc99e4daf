"""Tiny random-weight DeepSeek-V2 / V3 checkpoints built with transformers, and transformers' greedy reference.

Both mix a dense first layer (``first_k_dense_replace = 1``) with mixture-of-experts layers of 4 routed experts
(2 per token) and shared experts, so one checkpoint exercises multi-head latent attention and DeepSeek's MoE.
V2: no ``q_lora_rank`` (V2-Lite's direct query), default RoPE, interleaved RoPE rows (always, in V2); softmax
scores with group-limited greedy top-k (2 groups of 2, the best group by its best expert), no renormalisation,
``routed_scaling_factor`` 1.5, two shared experts. V3: ``q_lora_rank``, YaRN with ``mscale`` and
``mscale_all_dim`` (a softmax scale and a cos/sin factor that differ from 1), ``rope_interleave``; sigmoid
scores, a random ``e_score_correction_bias`` (it decides the choice, never the weight), the grouped top-k
(2 groups, the best group by the sum of its best two), renormalised weights times ``routed_scaling_factor``
2.5, one shared expert. Hidden 64, the embedded stories260K tokenizer.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM)

from pd_cluster.engine.assets import DEFAULT_MODEL

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # name: (HF model class, config class, extra config)
    "deepseek-v2": (DeepseekV2ForCausalLM, DeepseekV2Config, dict(
        num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
        topk_method="group_limited_greedy", n_group=2, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.5, n_shared_experts=2, moe_intermediate_size=32)),
    "deepseek-v3": (DeepseekV3ForCausalLM, DeepseekV3Config, dict(
        num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
        moe_intermediate_size=32, rope_interleave=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})),
}

# Five prompts of the embedded tokenizer's kind, longer than one 16-token page and of different lengths.
PROMPTS = [
    "Once upon a time, there was a little dog named Max who",
    "The sun was shining and the birds were singing in the tall green trees.",
    "Lily and Tom went to the park with their mom. They wanted to",
    "One day, a little bird flew down from the sky and landed on",
    "Sam had a red ball. He liked to throw it high in the air, but one day",
]


def build(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a random `family` model (sharded safetensors, real tensor names, the embedded tokenizer) in `out_dir`.

    Weights are drawn with std 1/sqrt(fan_in) and norms near 1 (HF's 0.02 init gives near-ties everywhere);
    V3's ``e_score_correction_bias`` (a buffer, zero at init) gets values of the size of the sigmoid scores'
    spread, so it changes some tokens' experts. `overrides` replace config keys.
    """
    cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**{**COMMON, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(out_dir)
    return model


@functools.lru_cache(maxsize=None)
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def prompt_ids(prompt: str) -> list[int]:
    return tokenizer()(prompt).input_ids


def hf_greedy_recompute(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation by full recompute: every step runs the whole sequence, no cache."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


class LatentDigest:
    """A TP rank extension (`RankServer.install`): a hash of the bytes of some pages of this rank's pool."""

    def __init__(self, shard, tp) -> None:
        self.pool = shard.pool

    def digest(self, pages: list[int]) -> str:
        import hashlib

        return hashlib.sha256(self.pool.read_pages(pages).numpy().tobytes()).hexdigest()
