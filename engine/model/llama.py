"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Phi-3) over a paged KV pool.

Follows the HF ``LlamaForCausalLM`` math: pre-norm RMSNorm, RoPE, GQA, SwiGLU.
Qwen2 adds q/k/v biases, Qwen3 an RMSNorm over each q and k head before RoPE.
Mixtral and Qwen3-MoE replace the MLP of their MoE layers by a `SparseMoE`
block (`pd_cluster.engine.model.moe`); Phi-3 rotates the first
``partial_rotary_factor`` of each head (and uses longrope, `rope`).
q/k/v and gate/up projections are fused into one matrix each (fewer kernel
launches); `pd_cluster.engine.model.loader` fills them from the HF checkpoint's separate
tensors.

The forward pass takes one explicit `ForwardBatch` and the `KVPool`; attention
goes through an `AttentionBackend`. Under tensor parallelism (`TPGroup` of N
ranks) each rank holds 1/N of the heads and of the MLP width, and the o and
down projections end with an all-reduce (Megatron-LM's split).
"""

from __future__ import annotations

import torch
from torch import nn

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TorchLayerOps
from pd_cluster.engine.model.moe import SharedExperts, SparseMoE
from pd_cluster.engine.model.rope import RotaryEmbedding, longrope_scaling
from pd_cluster.engine.parallel.group import SINGLE, TPGroup


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 as in HF Llama.

    `forward(x)` returns the normalised x; `forward(x, residual)` normalises
    ``x + residual`` and also returns that sum (the new residual), one fused
    launch under `TritonLayerOps`.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual_out = self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps,
                                              None if residual is None else residual.reshape(-1, x.shape[-1]))
        out = out.view(x.shape)
        return out if residual is None else (out, residual_out.view(x.shape))


class Attention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional q/k norm, RoPE, paged attention."""

    def __init__(self, cfg: ArchConfig, layer: int, rope: RotaryEmbedding, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim == self.head_dim:
            q, k = self.ops.rope_qk(q, k, cos, sin)
        else:  # partial rotary (Phi-3 family): the first rotary_dim dimensions of each head
            r = self.rotary_dim
            q_rot, k_rot = self.ops.rope_qk(q[..., :r], k[..., :r], cos, sin)
            q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        return self.tp.all_reduce(self.o_proj(backend.forward(self.layer, q, k, v, pool, batch)))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020) with fused gate/up projection."""

    def __init__(self, cfg: ArchConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm block. It carries the residual stream separately (vLLM's and SGLang's form): it takes
    (x, residual) and returns (mlp output, residual), so each residual add fuses into the next norm."""

    def __init__(self, cfg: ArchConfig, layer: int, rope: RotaryEmbedding, tp: TPGroup = SINGLE,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rope, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoE(cfg.hidden_size, cfg.moe, tp, expert_parallel)
                               if cfg.moe is not None and cfg.is_moe_layer(layer) else MLP(cfg, tp))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the residual stream starts as the embeddings
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, batch, pool, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        cfg: the architecture.
        tp: the tensor-parallel group (embedding, norms, routers and LM head are replicated).
        expert_parallel: MoE layers hold whole experts, E / tp.size per rank, instead of a slice of each.
        context_length: the server's context length (None: ``max_position_embeddings``); it chooses
            longrope's short or long factors (`rope.longrope_scaling`).

    `forward` returns logits [len(batch.logits_indices), vocab_size] in float32.

    Raises:
        ValueError: the TP size does not divide the heads, widths or experts (`ArchConfig.check_tp`).
    """

    def __init__(self, cfg: ArchConfig, tp: TPGroup = SINGLE, expert_parallel: bool = False,
                 context_length: int | None = None) -> None:
        super().__init__()
        cfg.check_tp(tp.size, expert_parallel)
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        scaling = longrope_scaling(cfg.rope_scaling, cfg.max_position_embeddings, context_length)
        rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
        self.rope = rope
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, tp, expert_parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def layer_ops(self) -> TorchLayerOps:
        return self.norm.ops

    def set_layer_ops(self, ops: TorchLayerOps) -> None:
        """Run the layers' norms, RoPE and activation through `ops` (`pd_cluster.engine.model.layer_ops`)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, SparseMoE, SharedExperts)):
                module.ops = ops

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.cos_sin(batch.positions, self.layer_ops.cos_sin_dtype(x.dtype))
        backend.prepare(batch, pool)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, pool, backend)
        rows = batch.logits_indices
        x = self.norm(x[rows]) if residual is None else self.norm(x[rows], residual[rows])[0]
        return self.lm_head(x).float()
