"""The decoder-only model over a paged KV pool: one shell for every family (`pd_cluster.engine.model.families`).

Embeddings, a stack of pre-norm decoder layers, the final norm and the LM head. What differs between families
is read from `ArchConfig`, never from an architecture name:

* the attention block: `layers.Attention` with K and V per head (q/k/v and o biases, q/k norms, partial or
  per-layer RoPE, NoPE layers, sinks, temperature tuning), or `mla_attention.MLAAttention` over one latent per
  token (``cfg.mla``);
* the MLP: dense SwiGLU / GeGLU, or the shared MoE block `moe.SparseMoE` on ``cfg.moe``'s layers;
* the norms: their style (`ArchConfig.norm_style`) and Gemma's sandwich norms (`ArchConfig.sandwich_norms`);
* scaled embeddings and soft-capped final logits (Gemma).

Each layer attends as its `LayerAttention` says and rotates with its own RoPE (one cos/sin table per step for
each distinct RoPE among the layers: Gemma 3's local and global ones), or none. q/k/v and gate/up projections
are fused into one matrix each (fewer kernel launches); `pd_cluster.engine.model.loader` fills them from the
checkpoint's separate tensors. The forward pass takes one explicit `ForwardBatch` and the `KVPool`; attention
goes through the backend. Under tensor parallelism (`TPGroup` of N ranks) each rank holds 1/N of the heads and
of the MLP width, and the o and down projections end with an all-reduce (Megatron-LM's split).
"""

from __future__ import annotations

import torch
from torch import nn

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.layer_attention import rope_key
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.layer_ops import TorchLayerOps
from pd_cluster.engine.model.layers import MLP, Attention, RMSNorm
from pd_cluster.engine.model.mla_attention import MLAAttention
from pd_cluster.engine.model.moe import SparseMoE
from pd_cluster.engine.model.rope import RotaryEmbedding, longrope_scaling
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

CosSin = tuple[torch.Tensor, torch.Tensor]


def build_mlp(cfg: ArchConfig, layer: int, tp: TPGroup, expert_parallel: bool = False) -> nn.Module:
    """The MLP of `layer`: the `SparseMoE` block where ``cfg.is_moe_layer(layer)``, else the dense MLP.

    Raises:
        ValueError: the TP size does not divide the expert width (or, with `expert_parallel`, their count).
    """
    if cfg.moe is not None and cfg.is_moe_layer(layer):
        return SparseMoE(cfg.hidden_size, cfg.moe, tp, expert_parallel)
    return MLP(cfg, tp)


def attention_class(cfg: ArchConfig) -> type[Attention] | type[MLAAttention]:
    """The attention block of `cfg`: latent attention under MLA, else K and V per head."""
    return MLAAttention if cfg.mla is not None else Attention


class DecoderLayer(nn.Module):
    """Pre-norm block. It carries the residual stream separately (vLLM's and SGLang's form): it takes
    (x, residual) and returns (mlp output, residual), so each residual add fuses into the next norm. With
    `ArchConfig.sandwich_norms` (Gemma) the attention output is normalised before its residual add, and the
    MLP has a norm before (fused with that add) and after it."""

    def __init__(self, cfg: ArchConfig, layer: int, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = attention_class(cfg)(cfg, layer, tp)
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = build_mlp(cfg, layer, tp, expert_parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin | None,
                batch: ForwardBatch, pool: KVPool, backend) -> tuple[torch.Tensor, torch.Tensor]:
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


class CausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        cfg: the architecture.
        tp: the tensor-parallel group (embedding, norms, routers and LM head are replicated).
        expert_parallel: MoE layers hold whole experts, E / tp.size per rank, instead of a slice of each.
        context_length: the server's context length (None: ``max_position_embeddings``); it chooses
            longrope's short or long factors (`rope.longrope_scaling`).

    `forward(batch, pool, backend)` returns logits [len(batch.logits_indices), vocab_size] in float32; `backend`
    is an `AttentionBackend`, or an `MLAAttentionBackend` under MLA.

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
        """Run the layers' norms, RoPE and activations through `ops` (`pd_cluster.engine.model.layer_ops`)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The loader's hook: `tensor` (this rank's shard of checkpoint tensor `name`, ``model.`` removed) as the
        module holds it (the attention block's row order: `Attention.checkpoint_tensor`,
        `MLAAttention.checkpoint_tensor`)."""
        return attention_class(self.cfg).checkpoint_tensor(self.cfg, name, tensor)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, backend) -> torch.Tensor:
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
