"""Multi-head latent attention (DeepSeek-AI, "DeepSeek-V2", 2024, sec. 2.1): one layer's projections over a latent
KV pool.

Follows transformers' DeepSeek-V2/V3 attention: a low-rank query (``q_a_proj``, its norm, ``q_b_proj``) or a
direct one (``q_proj``: V2-Lite), the compressed KV ``kv_a_proj_with_mqa`` whose first ``kv_lora_rank`` values
are normalised into ``c`` and whose last ``qk_rope_head_dim`` are the shared RoPE key ``k_pe``. The layer caches
one latent ``[c, k_pe]`` per token (`pd_cluster.engine.kv.pool`, kv_format ``mla``) and attends through an
`MLAAttentionBackend`: expanded for prefill chunks, absorbed for decodes (`pd_cluster.engine.attention.mla`).

RoPE: checkpoints lay the rotary dimensions out in interleaved pairs (`MLAConfig.rope_interleave`). The loader
permutes those rows of ``q_proj``/``q_b_proj`` and ``kv_a_proj_with_mqa`` into the rotate-half order
(`checkpoint_tensor`), so the engine's one RoPE op (torch or fused Triton) applies; q.k is unchanged by a
permutation applied to both, and transformers' V3 code computes exactly this rotate-half form on
de-interleaved values.

Tensor parallelism (Megatron-LM's split, as vLLM's and SGLang's DeepSeek): the query projections and
``kv_b_proj`` are cut by output rows (heads), ``o_proj`` by input columns with an all-reduce after it;
``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms are replicated, so every rank computes and caches the
same latent.
"""

from __future__ import annotations

import torch
from torch import nn

from pd_cluster.engine.attention.mla import MLAAttentionBackend
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TorchLayerOps
from pd_cluster.engine.model.layers import Norm
from pd_cluster.engine.model.rope import deinterleave_rope_rows
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


class MLAAttention(nn.Module):
    """One layer's latent attention: low-rank or direct query, the latent, RoPE, the backend."""

    def __init__(self, cfg: ArchConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        m = cfg.mla
        self.layer, self.tp, self.m = layer, tp, m
        self.num_heads = cfg.num_attention_heads // tp.size
        h, q_out = cfg.hidden_size, self.num_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = make_linear(h, q_out, bias=False)
        else:
            self.q_a_proj = make_linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = Norm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = make_linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = make_linear(h, m.latent_dim, bias=False)
        self.kv_a_layernorm = Norm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = make_linear(m.kv_lora_rank, self.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = make_linear(self.num_heads * m.v_head_dim, h, bias=False)
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                pool: KVPool, backend: MLAAttentionBackend) -> torch.Tensor:
        m = self.m
        cos, sin = cos_sin
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        ckv = self.kv_a_proj_with_mqa(x)  # [T, kv_lora_rank + qk_rope_head_dim]
        c = self.kv_a_layernorm(ckv[:, :m.kv_lora_rank])
        q_pe, k_pe = self.ops.rope_qk(q_pe, ckv[:, None, m.kv_lora_rank:], cos, sin)
        latent = torch.cat((c, k_pe[:, 0]), dim=-1)
        out = backend.forward(self.layer, q_nope, q_pe, latent, self.kv_b_proj.weight, pool, batch)
        return self.tp.all_reduce(self.o_proj(out))

    @staticmethod
    def checkpoint_tensor(cfg: ArchConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (this rank's shard of checkpoint tensor `name`) as the module holds it: interleaved RoPE rows
        in rotate-half order (module docstring)."""
        m = cfg.mla
        if not m.rope_interleave or not name.endswith("weight"):
            return tensor
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            rows = tensor.view(-1, m.qk_head_dim, tensor.shape[-1])
            return deinterleave_rope_rows(rows, m.qk_nope_head_dim).view(tensor.shape)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            return deinterleave_rope_rows(tensor, m.kv_lora_rank)
        return tensor
