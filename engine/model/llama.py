"""Llama-family decoder over a paged KV pool: Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Phi-3,
Gemma 2, Gemma 3 (text), gpt-oss and Llama 4 (text).

Follows the HF ``LlamaForCausalLM`` math: pre-norm RMSNorm, RoPE, GQA, SwiGLU.
Qwen2 adds q/k/v biases, Qwen3 an RMSNorm over each q and k head before RoPE.
Mixtral, Qwen3-MoE, gpt-oss and Llama 4 replace the MLP of their MoE layers by a
`SparseMoE` block (`pd_cluster.engine.model.moe`); Phi-3 rotates the first
``partial_rotary_factor`` of each head (and uses longrope, `rope`). Gemma adds
norms after attention and around the MLP (`ArchConfig.sandwich_norms`), scales
the embeddings and soft-caps the final logits. Each layer attends as its
`LayerAttention` says (full, sliding window or chunked; the backends apply the
masks, sinks and logit softcapping) and rotates with its own RoPE, or none
(`pd_cluster.engine.model.layers`).
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
from pd_cluster.engine.layer_attention import rope_key
from pd_cluster.engine.model.layer_ops import TorchLayerOps
from pd_cluster.engine.model.layers import MLP, Attention, RMSNorm
from pd_cluster.engine.model.moe import SharedExperts, SparseMoE
from pd_cluster.engine.model.rope import RotaryEmbedding, deinterleave_rope_rows, longrope_scaling
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

__all__ = ["MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "RMSNorm"]

CosSin = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    """Pre-norm block. It carries the residual stream separately (vLLM's and SGLang's form): it takes
    (x, residual) and returns (mlp output, residual), so each residual add fuses into the next norm. With
    `ArchConfig.sandwich_norms` (Gemma) the attention output is normalised before its residual add, and the
    MLP has a norm before (fused with that add) and after it."""

    def __init__(self, cfg: ArchConfig, layer: int, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp: nn.Module = (SparseMoE(cfg.hidden_size, cfg.moe, tp, expert_parallel)
                               if cfg.moe is not None and cfg.is_moe_layer(layer) else MLP(cfg, tp))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin | None,
                batch: ForwardBatch, pool: KVPool, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the residual stream starts as the embeddings
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, batch, pool, backend)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        cfg: the architecture.
        tp: the tensor-parallel group (embedding, norms, routers and LM head are replicated).
        expert_parallel: MoE layers hold whole experts, E / tp.size per rank, instead of a slice of each.
        context_length: the server's context length (None: ``max_position_embeddings``); it chooses
            longrope's short or long factors (`rope.longrope_scaling`).

    `forward` returns logits [len(batch.logits_indices), vocab_size] in float32. One cos/sin table is
    computed per step for each distinct RoPE among the layers (Gemma 3: its local and global ones).

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
        # Gemma: sqrt(hidden_size), applied rounded to the activation dtype (a buffer: no host copy per step)
        self.register_buffer("embed_scale", torch.tensor(cfg.embedding_scale or 1.0, dtype=torch.float32),
                             persistent=False)
        keys: list[str] = []
        ropes: list[RotaryEmbedding] = []
        self.layer_rope: list[int] = []  # index into self.ropes, -1 for a NoPE layer
        for spec in cfg.layer_attention:
            key = rope_key(spec)
            if key is not None and key not in keys:
                keys.append(key)
                scaling = longrope_scaling(spec.rope_scaling, cfg.max_position_embeddings, context_length)
                ropes.append(RotaryEmbedding(cfg.rotary_dim, spec.rope_theta, scaling, cfg.max_position_embeddings))
            self.layer_rope.append(-1 if key is None else keys.index(key))
        self.ropes = nn.ModuleList(ropes)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, expert_parallel) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The loader's hook: `tensor` (this rank's shard of checkpoint tensor `name`, ``model.`` removed) as the
        module holds it. Llama 4 rotates interleaved pairs: each q and k head's rows (and biases) are put in
        rotate-half order, ``0, 2, 4, ..., 1, 3, 5, ...``, which leaves every q.k unchanged (the L2 norm too)."""
        if not self.cfg.rope_interleaved or not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                                "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
            return tensor
        d = self.cfg.head_dim
        rows = tensor.reshape(-1, d, tensor.shape[-1] if tensor.dim() == 2 else 1)
        return deinterleave_rope_rows(rows, 0).reshape(tensor.shape)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        if self.cfg.embedding_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        dtype = self.layer_ops.cos_sin_dtype(x.dtype)
        tables = [rope.cos_sin(batch.positions, dtype) for rope in self.ropes]
        backend.prepare(batch, pool)
        residual = None
        for layer, rope in zip(self.layers, self.layer_rope):
            x, residual = layer(x, residual, tables[rope] if rope >= 0 else None, batch, pool, backend)
        rows = batch.logits_indices
        x = self.norm(x[rows]) if residual is None else self.norm(x[rows], residual[rows])[0]
        logits = self.lm_head(x)
        cap = self.cfg.final_logit_softcap
        if cap is not None:  # Gemma 2: in the activation dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
