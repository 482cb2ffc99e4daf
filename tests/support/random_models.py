"""Tiny random-weight HF checkpoints of each supported family, built with transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import (AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

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
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
    "qwen2-yarn": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
    "llama-linear-rope": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "linear", "factor": 2.0})),
}


def build(family: str, out_dir: Path, seed: int = 0):
    """Save a random model of `family` (sharded safetensors + the embedded tokenizer) into `out_dir`.

    Weights are drawn with std 1/sqrt(fan_in) and norms near 1, so logits are far
    from uniform (HF's default 0.02 init gives near-ties everywhere).
    """
    cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(out_dir, max_shard_size="200KB")  # several shards + model.safetensors.index.json
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(out_dir)
    return model


def engine_logits(path: Path, ids: list[int], kv_cache_dtype: str = "fp32", page_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill through the engine's model, pool and reference attention."""
    lm = load_model(str(path))
    a = lm.arch
    layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, page_size, kv_cache_dtype,
                      tuple(lm.k_scales), tuple(lm.v_scales))
    pool = KVPool(layout, 64, "cpu", torch.float32)
    backend = TorchAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5)
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
