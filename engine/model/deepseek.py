"""DeepSeek-V2/V3 decoder (and Kimi K2's shape) with multi-head latent attention over a latent KV pool.

Follows transformers' ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``:
pre-norm RMSNorm blocks, MLA attention (`MLAAttention`), dense SwiGLU or
mixture-of-experts MLPs, an untied or tied LM head. The attention caches one latent per token per layer
(`pd_cluster.engine.kv.pool`, kv_format ``mla``) and runs through an
`MLAAttentionBackend`: expanded for prefill chunks, absorbed for decodes
(`pd_cluster.engine.attention.mla`).

The MLP of each layer comes from `build_mlp`: dense SwiGLU (``intermediate_size``)
for the layers before ``first_k_dense_replace`` (and for every layer of a config
without routed experts), and the shared MoE block `pd_cluster.engine.model.moe.SparseMoE`
for the others (``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``, as
DeepSeek's reference code and vLLM place them; transformers 5.24 ignores
``moe_layer_freq``, which is 1 in every released checkpoint). Its routing is
`moe_config.moe_from_hf`'s: DeepSeek-V2's softmax with greedy or group-limited
top-k, DeepSeek-V3's sigmoid scores with ``e_score_correction_bias`` and the
grouped top-k (``n_group``, ``topk_group``), ``routed_scaling_factor``, and the
shared experts every token goes through.

RoPE: DeepSeek checkpoints lay the rotary dimensions out in interleaved pairs.
The loader permutes those rows of ``q_proj``/``q_b_proj`` and
``kv_a_proj_with_mqa`` into the rotate-half order (`deinterleave_rope_rows`), so
the engine's one RoPE op (torch or fused Triton) applies; q.k is unchanged by a
permutation applied to both, and transformers' V3 code computes exactly this
rotate-half form on de-interleaved values.

Tensor parallelism (Megatron-LM's split, as vLLM's and SGLang's DeepSeek): the
query projections (``q_proj`` or ``q_b_proj``), ``kv_b_proj`` and the MLP's
gate/up are cut by output rows (heads), ``o_proj`` and ``down_proj`` by input
columns with an all-reduce after them; ``q_a_proj``, ``kv_a_proj_with_mqa`` and
their norms are replicated, so every rank computes and caches the same latent.
MoE layers split each expert's width (and the shared experts'), or with expert
parallelism hold ``n_routed_experts / tp`` whole experts per rank; the router is
replicated (`pd_cluster.engine.model.moe`).
"""

from __future__ import annotations

import torch
from torch import nn

from pd_cluster.engine.attention.mla import MLAAttentionBackend
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TorchLayerOps
from pd_cluster.engine.model.llama import MLP, RMSNorm
from pd_cluster.engine.model.moe import SparseMoE
from pd_cluster.engine.model.rope import RotaryEmbedding, deinterleave_rope_rows
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


class MLAAttention(nn.Module):
    """One layer's latent attention: low-rank (V3) or direct (V2-Lite) query, the latent, RoPE, the backend."""

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
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = make_linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = make_linear(h, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = make_linear(m.kv_lora_rank, self.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = make_linear(self.num_heads * m.v_head_dim, h, bias=False)
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                pool: KVPool, backend: MLAAttentionBackend) -> torch.Tensor:
        m = self.m
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        ckv = self.kv_a_proj_with_mqa(x)  # [T, kv_lora_rank + qk_rope_head_dim]
        c = self.kv_a_layernorm(ckv[:, :m.kv_lora_rank])
        q_pe, k_pe = self.ops.rope_qk(q_pe, ckv[:, None, m.kv_lora_rank:], cos, sin)
        latent = torch.cat((c, k_pe[:, 0]), dim=-1)
        out = backend.forward(self.layer, q_nope, q_pe, latent, self.kv_b_proj.weight, pool, batch)
        return self.tp.all_reduce(self.o_proj(out))


def build_mlp(cfg: ArchConfig, layer: int, tp: TPGroup, expert_parallel: bool = False) -> nn.Module:
    """The MLP of `layer`: a `SparseMoE` block (routed experts of ``moe_intermediate_size`` plus the shared
    experts) where ``cfg.is_moe_layer(layer)``, else dense SwiGLU of ``intermediate_size``.

    Raises:
        ValueError: the TP size does not divide the expert width (or, with `expert_parallel`, their count).
    """
    if cfg.moe is not None and cfg.is_moe_layer(layer):
        return SparseMoE(cfg.hidden_size, cfg.moe, tp, expert_parallel)
    return MLP(cfg, tp)


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block carrying the residual stream separately, like `llama.DecoderLayer`."""

    def __init__(self, cfg: ArchConfig, layer: int, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = build_mlp(cfg, layer, tp, expert_parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, backend: MLAAttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, batch, pool, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekForCausalLM(nn.Module):
    """The DeepSeek decoder plus LM head.

    Args:
        cfg: the architecture (``cfg.mla`` set).
        tp: the tensor-parallel group.
        expert_parallel: MoE layers hold whole experts, ``n_routed_experts / tp.size`` per rank, instead of a
            slice of each.

    `forward(batch, pool, backend)` returns logits [len(batch.logits_indices), vocab_size] in float32.

    Raises:
        ValueError: the TP size does not divide the heads, the MLP widths or the experts (`ArchConfig.check_tp`).
    """

    # HF name part -> (fused name part, shard index): only the dense MLP's gate/up are fused here (the experts'
    # and shared experts' go through weight_map)
    FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ArchConfig, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} has no MLA configuration")
        cfg.check_tp(tp.size, expert_parallel)
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, tp, expert_parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def layer_ops(self) -> TorchLayerOps:
        return self.norm.ops

    def set_layer_ops(self, ops: TorchLayerOps) -> None:
        """Run the norms, RoPE and activation through `ops` (`pd_cluster.engine.model.layer_ops`)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The loader's hook: `tensor` (this rank's shard of checkpoint tensor `name`, ``model.`` removed) as
        the module holds it. Interleaved RoPE rows become rotate-half order (module docstring)."""
        m = self.cfg.mla
        if not m.rope_interleave or not name.endswith("weight"):
            return tensor
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            rows = tensor.view(-1, m.qk_head_dim, tensor.shape[-1])
            return deinterleave_rope_rows(rows, m.qk_nope_head_dim).view(tensor.shape)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            return deinterleave_rope_rows(tensor, m.kv_lora_rank)
        return tensor

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, backend: MLAAttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.cos_sin(batch.positions, self.layer_ops.cos_sin_dtype(x.dtype))
        backend.prepare(batch, pool)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, pool, backend)
        rows = batch.logits_indices
        x = self.norm(x[rows]) if residual is None else self.norm(x[rows], residual[rows])[0]
        return self.lm_head(x).float()
