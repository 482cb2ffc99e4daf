"""The building blocks of a decoder layer with K and V per head: the norms, self-attention and the MLP.

Each block reads what differs between families from `ArchConfig` (and the layer's `LayerAttention`):

* `Norm`: an RMSNorm applying its weight Llama's way (``w * round(x_normed)``), Gemma's (``round((1 + w)
  x_normed)`` in float32) or gpt-oss's (``round(w x_normed)`` in float32), or a LayerNorm: Cohere's (mean
  removed, weight alone, in float32) or torch's with weight and bias (`ArchConfig.norm_style`);
* attention: q/k/v (and o) biases, q/k norms before RoPE (per head: Qwen3 RMSNorm, Gemma 3's ``(1 + w)`` norm;
  across all heads: OLMo 2) or an L2 norm after it (Llama 4, RoPE layers only), RoPE over the whole head or its
  first ``rotary_dim`` dimensions, the layer's own RoPE or none (NoPE), Llama 4's attention temperature on NoPE
  layers, gpt-oss's sinks (passed to the backend, which owns the softmax), Qwen3-Next's output gate
  (``sigmoid(gate) * out`` before ``o_proj``, the gate projected with q: `ArchConfig.attn_output_gate`);
* MLP: SwiGLU (``silu``) or GeGLU (``gelu_pytorch_tanh``), or not gated (``down(gelu(up(x)))``, StarCoder2),
  with or without biases.

The element-wise ops go through `LayerOps` (torch reference, or fused Triton kernels). Under tensor parallelism
each rank holds 1/N of the heads and of the MLP width; the o and down projections end with an all-reduce, and
their biases are added once, after it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TorchLayerOps
from pd_cluster.engine.model.rope import deinterleave_rope_rows
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import linear_no_bias, make_linear


class Norm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) or LayerNorm (Ba et al. 2016) of the last dimension, per `style`
    (`ArchConfig.norm_style`); RMSNorms are computed in float32.

    `forward(x)` returns the normalised x; `forward(x, residual)` normalises ``x + residual`` and also returns
    that sum (the new residual), one fused launch under `TritonLayerOps` (for the RMSNorm styles).

    Args:
        dim: the normalised width.
        eps: the variance epsilon.
        style: ``llama``, ``gemma``, ``float``, ``layernorm`` or ``layernorm_bias``.
        learned: False for a norm without weight (Llama 4's L2 q/k norm: a buffer of ones, ``float`` style).
    """

    def __init__(self, dim: int, eps: float, style: str = "llama", learned: bool = True) -> None:
        super().__init__()
        if learned:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_buffer("weight", torch.ones(dim), persistent=False)
        self.bias = nn.Parameter(torch.zeros(dim)) if style == "layernorm_bias" else None
        self.eps = eps
        self.style = style
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        rows = x.reshape(-1, x.shape[-1])
        res = None if residual is None else residual.reshape(-1, x.shape[-1])
        if self.style.startswith("layernorm"):
            out, residual_out = self.ops.layer_norm(rows, self.weight, self.bias, self.eps, res)
        else:
            out, residual_out = self.ops.rms_norm(rows, self.weight, self.eps, res, self.style)
        out = out.view(x.shape)
        return out if residual is None else (out, residual_out.view(x.shape))


class AcrossHeadsNorm(nn.Module):
    """OLMo 2's q or k norm: one ``float``-style RMSNorm over all heads of the projection (not per head). Under TP
    each rank holds its heads: the sum of squares is all-reduced, and the rank multiplies by its slice of the
    whole weight (``weight`` [total] is replicated).

    Args:
        total: the projection's width over all ranks (``heads * head_dim``); local: this rank's.
    """

    def __init__(self, total: int, local: int, eps: float, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(total))
        self.total, self.local, self.eps, self.tp = total, local, eps, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, local] -> normalised [T, local] in x's dtype."""
        h = x.float()
        if self.tp.size == 1:
            var = h.pow(2).mean(-1, keepdim=True)
        else:
            var = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.total
        w = self.weight[self.tp.rank * self.local:(self.tp.rank + 1) * self.local]
        return (w * (h * torch.rsqrt(var + self.eps))).to(x.dtype)


def add_bias_once(tp: TPGroup, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The all-reduce of a row-parallel projection's partial output `out` (no bias in it), plus `bias` once."""
    out = tp.all_reduce(out)
    return out if bias is None else out + bias


class Attention(nn.Module):
    """Self-attention of one layer: fused qkv projection, q/k norms, RoPE, paged attention (module docstring)."""

    def __init__(self, cfg: ArchConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.spec = cfg.layer_attention[layer]
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.gated = cfg.attn_output_gate  # q_proj gives each head's q, then its gate (Qwen3-Next)
        self.q_proj_size = self.q_size * (2 if self.gated else 1)
        self.qkv_proj = make_linear(cfg.hidden_size, self.q_proj_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = make_linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        norm = cfg.qk_norm
        self.q_norm = self.k_norm = self.l2_norm = None
        self.across = norm == "rms_across"
        if norm in ("rms", "gemma"):  # before RoPE, one weight per head dimension
            style = "gemma" if norm == "gemma" else "llama"
            self.q_norm = Norm(self.head_dim, cfg.rms_norm_eps, style)
            self.k_norm = Norm(self.head_dim, cfg.rms_norm_eps, style)
        elif self.across:  # before RoPE, over all heads of q and of k
            self.q_norm = AcrossHeadsNorm(cfg.q_size, self.q_size, cfg.rms_norm_eps, tp)
            self.k_norm = AcrossHeadsNorm(cfg.kv_size, self.kv_size, cfg.rms_norm_eps, tp)
        elif norm == "l2" and self.spec.rope:  # Llama 4: after RoPE, RoPE layers only
            self.l2_norm = Norm(self.head_dim, cfg.rms_norm_eps, "float", learned=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if self.spec.sinks else None
        self.temperature = cfg.attn_temperature if not self.spec.rope else None
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, batch: ForwardBatch,
                pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden]; `cos_sin` the step's table of this layer's RoPE (None: a NoPE layer)."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_proj_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(-1, self.q_size), gate.reshape(-1, self.q_size)
        if self.across:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.across:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin is not None:
            q, k = self._rope(q, k, *cos_sin)
        if self.l2_norm is not None:
            q, k = self.l2_norm(q), self.l2_norm(k)
        if self.temperature is not None:
            q = self._temperature(q, batch.positions)
        out = backend.forward(self.layer, q, k, v, pool, batch.for_group(pool.group_of(self.layer)), sinks=self.sinks)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        if self.tp.size == 1:
            return self.o_proj(out)
        return add_bias_once(self.tp, linear_no_bias(self.o_proj, out), self.o_proj.bias)

    @staticmethod
    def checkpoint_tensor(cfg: ArchConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (this rank's shard of checkpoint tensor `name`) as the module holds it. With
        `ArchConfig.rope_interleaved` the rotary rows of each q and k head (and of their biases) are put in
        rotate-half order, ``0, 2, 4, ..., 1, 3, 5, ...``, which leaves every q.k unchanged (an L2 norm too)."""
        if not cfg.rope_interleaved or not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                           "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
            return tensor
        rows = tensor.reshape(-1, cfg.head_dim, tensor.shape[-1] if tensor.dim() == 2 else 1)
        r = cfg.rotary_dim
        return torch.cat((deinterleave_rope_rows(rows[:, :r], 0), rows[:, r:]), dim=1).reshape(tensor.shape)

    def _rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.rotary_dim == self.head_dim:
            return self.ops.rope_qk(q, k, cos, sin)
        r = self.rotary_dim  # partial rotary: the first rotary_dim dimensions of each head
        q_rot, k_rot = self.ops.rope_qk(q[..., :r], k[..., :r], cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def _temperature(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's attention temperature tuning (Nakanishi, "Scalable-Softmax Is Superior for Attention", 2025;
        transformers' ``Llama4TextAttention``): ``q * (1 + attn_scale * log1p(floor((p + 1) / floor_scale)))``."""
        attn_scale, floor_scale = self.temperature
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales[:, None, None]).to(q.dtype)


class MLP(nn.Module):
    """Feed-forward: gated with a fused gate/up projection, SwiGLU (Shazeer 2020) or GeGLU, or not gated
    (``down(gelu_tanh(up(x)))``: `ArchConfig.mlp_gated`); biases with `ArchConfig.mlp_bias`.

    Args:
        cfg: the architecture (``hidden_act``, ``mlp_gated``, ``mlp_bias``).
        tp: the tensor-parallel group.
        intermediate_size: the width, default ``cfg.intermediate_size``.
    """

    def __init__(self, cfg: ArchConfig, tp: TPGroup = SINGLE, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gated = cfg.mlp_gated
        self.intermediate_size = (intermediate_size or cfg.intermediate_size) // tp.size
        if self.gated:
            self.gate_up_proj = make_linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        else:
            self.up_proj = make_linear(cfg.hidden_size, self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = make_linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            act = F.gelu(self.up_proj(x), approximate="tanh")
        else:
            h = self.gate_up_proj(x)
            act = self.ops.gelu_tanh_and_mul(h) if self.gelu else self.ops.silu_and_mul(h)
        if self.tp.size == 1:
            return self.down_proj(act)
        return add_bias_once(self.tp, linear_no_bias(self.down_proj, act), self.down_proj.bias)
