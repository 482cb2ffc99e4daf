"""Tiny random-weight HF checkpoints of each supported family, built with transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import (AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.loader import load_model

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
              max_position_embeddings=1024)

FAMILIES = {
    # name: (HF model class, config class, extra config)
    "llama-gqa4": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2)),
    "qwen2-bias-tied": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": (Qwen3ForCausalLM, Qwen3Config, dict(num_key_value_heads=4, head_dim=16)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "mistral-window": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=16)),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
    "qwen2-yarn": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
    "llama-linear-rope": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "linear", "factor": 2.0})),
    # mixture of experts: 4 experts of width 32, 2 per token
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(num_key_value_heads=2, intermediate_size=32,
                                                        num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1])),  # layer 1 is a dense MLP of intermediate_size
    "qwen3-moe-sparse-step": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        num_key_value_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=False, decoder_sparse_step=2)),  # MoE on layer 1 only; weights not renormalised
    "phi3": (Phi3ForCausalLM, Phi3Config, dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                               eos_token_id=2)),
    # longrope with its attention factor (max_position_embeddings / original = 16): sequences past 64 tokens use
    # the long factors (the engine's default context length, 1024, is past 64 too)
    "phi3-longrope-partial": (Phi3ForCausalLM, Phi3Config, dict(
        num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3], "long_factor": [3.0, 7.0]})),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe", "qwen3-moe-sparse-step")


def hf_config(family: str, **overrides):
    """The transformers config of `family` (`overrides` replace its keys)."""
    _, cfg_cls, extra = FAMILIES[family]
    return cfg_cls(**{**COMMON, **extra, **overrides})


def build(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a random model of `family` (sharded safetensors + the embedded tokenizer) into `out_dir`;
    `overrides` replace config keys.

    Weights are drawn with std 1/sqrt(fan_in) and norms near 1, so logits are far
    from uniform (HF's default 0.02 init gives near-ties everywhere).
    """
    torch.manual_seed(seed)
    model = FAMILIES[family][0](hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(out_dir, max_shard_size="200KB")  # several shards + model.safetensors.index.json
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(out_dir)
    return model


def prompt_ids(n: int = 5) -> list[list[int]]:
    """The first `n` TinyStories prompts of `engine_reference.PROMPTS` as the embedded tokenizer's ids."""
    from engine_reference import PROMPTS

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return [tok(p).input_ids for p in PROMPTS[:n]]


def hf_greedy_full(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation by full recompute: every token is the argmax of the last position of a
    fresh forward pass over the whole sequence (no KV cache)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def engine_logits(path: Path, ids: list[int], kv_cache_dtype: str = "fp32", page_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill through the engine's model, pool and reference attention."""
    lm = load_model(str(path))
    a = lm.arch
    layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, page_size, kv_cache_dtype,
                      tuple(lm.k_scales), tuple(lm.v_scales))
    pool = KVPool(layout, 64, "cpu", torch.float32)
    backend = TorchAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5,
                                    sliding_window=a.sliding_window)
    pages = list(range(1, -(-len(ids) // page_size) + 1))
    batch = build_forward_batch([np.array(ids)], [0], [pages], [np.arange(len(ids))], 0, page_size,
                                torch.device("cpu"))
    return lm.model(batch, pool, backend)


class RelativeNoiseCache(DynamicCache):
    """Stores K and V multiplied by (1 + U(-u, u)): random relative errors of at most `u`."""

    def __init__(self, u: float, seed: int, **kwargs):
        super().__init__(**kwargs)
        self.u = u
        self.gen = torch.Generator().manual_seed(seed)

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + self.u * (2 * torch.rand(x.shape, generator=self.gen) - 1))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._noise(key_states), self._noise(value_states), layer_idx, *args, **kwargs)


def row_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over positions of ||out - ref|| / ||ref|| (per-position logit vectors)."""
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()
