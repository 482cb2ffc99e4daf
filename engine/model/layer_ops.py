"""The element-wise ops of a decoder layer, behind one small interface: torch (the reference) or fused Triton.

`LayerOps` has these ops, each the unit vLLM and SGLang fuse into one kernel:

* ``rms_norm(x, weight, eps, residual, style)``: RMSNorm of ``x + residual``; returns the
  normalised rows and the new residual (the pre-norm residual stream never
  materialises as a separate add); `style` is how the weight applies (`ArchConfig.norm_style`);
* ``layer_norm(x, weight, bias, eps, residual)``: LayerNorm of ``x + residual`` (torch's with a bias; without
  one, Cohere's: weight multiplied in float32); torch in both classes;
* ``rope_qk(q, k, cos, sin)``: RoPE on q and k;
* ``silu_and_mul(x)``: SwiGLU's activation over the fused gate/up output; ``gelu_tanh_and_mul(x)``
  Gemma's GeGLU; ``swiglu_clamped(x, alpha, limit)`` gpt-oss's experts' clamped SwiGLU;
* ``fused_experts(x, w13, w2, weights, ids, ...)``: a mixture-of-experts layer's routed experts
  (`pd_cluster.engine.model.moe`; Triton: tokens sorted by expert, grouped GEMMs).

`TorchLayerOps` is the reference and runs anywhere. `TritonLayerOps` launches
one kernel per op (`pd_cluster.engine.attention.triton.fused`); the model uses it
with the triton attention backend (`CausalLM.set_layer_ops`). Under
``TRITON_INTERPRET=1`` it runs on CPU, which is how CI checks it.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from pd_cluster.engine.quant.experts import QuantizedExperts, expert_weight, fake_quant_fp8_groups


class TorchLayerOps:
    """The reference: plain torch ops, the math of HF's Llama."""

    name = "torch"
    fp8_activations = False  # FP8 block experts: quantise each GEMM's input per token group (W8A8's math)

    def cos_sin_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the step's cos/sin table: the activation dtype, as HF Llama does."""
        return act_dtype

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 style: str = "llama") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``weight * normalize(x + residual)``, ``x + residual`` or None); x [T, N], computed in float32.

        `style`: ``llama`` rounds the normalised rows to x's dtype, then multiplies by the weight (HF Llama);
        ``gemma`` multiplies by ``1 + weight`` in float32 and rounds once (Gemma); ``float`` multiplies by the
        weight in float32 and rounds once (gpt-oss; with a weight of ones, Llama 4's L2 norm).
        """
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if style == "gemma":
            return (h * (1.0 + weight.float())).to(dtype), residual
        if style == "float":
            return (weight.float() * h).to(dtype), residual
        return weight * h.to(dtype), residual

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LayerNorm of ``x + residual``, ``x + residual`` or None); x [T, N]. With `bias`: torch's
        ``layer_norm`` in x's dtype (transformers' ``nn.LayerNorm``); without: mean and variance in float32, the
        weight multiplied in float32, rounded once (transformers' ``CohereLayerNorm``)."""
        if residual is not None:
            x = x + residual
            residual = x
        if bias is not None:
            return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), residual
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * h).to(x.dtype), residual

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] rotated by cos/sin [T, D // 2] (rotate-half form); new tensors."""
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :N]) * x[:, N:]`` for x [T, 2N]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(x[:, :N]) * x[:, N:]`` for x [T, 2N] (GeGLU, Shazeer 2020; transformers'
        ``gelu_pytorch_tanh``)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def swiglu_clamped(self, x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's expert activation for x [T, 2N] (gate half, up half): ``g = min(gate, limit)``,
        ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)`` (``GptOssExperts._apply_gate``)."""
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, apply_weights_on_input: bool = False, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None, activation: tuple = ("silu",)) -> torch.Tensor:
        """Routed experts' output [T, H] (`torch_fused_experts`: shapes, -1 ids, biases, activation; quantised
        experts dequantised one at a time, FP8 activations quantised only with `fp8_activations`)."""
        return torch_fused_experts(x, w13, w2, weights, ids, self, apply_weights_on_input, b13, b2, activation,
                                   self.fp8_activations)

    def activation(self, x: torch.Tensor, activation: tuple) -> torch.Tensor:
        """An expert activation named by `activation`: ``("silu",)`` or ``("swiglu_clamped", alpha, limit)``."""
        if activation[0] == "swiglu_clamped":
            return self.swiglu_clamped(x, activation[1], activation[2])
        return self.silu_and_mul(x)

    def warm_up_experts(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype,
                        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        activation: tuple = ("silu",)) -> None:
        """Compile what a start-up step does not (nothing to compile here)."""


class TritonLayerOps(TorchLayerOps):
    """One Triton launch per op; float32 cos/sin (the kernel computes in float32 anyway)."""

    name = "triton"
    fp8_activations = True  # FP8 block experts run W8A8, as vLLM's and SGLang's fused MoE

    def __init__(self) -> None:
        from pd_cluster.engine.attention.triton import fused  # imported here: torch-only installs never need triton

        self._fused = fused

    def cos_sin_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def rms_norm(self, x, weight, eps, residual=None, style="llama"):
        return self._fused.rms_norm(x, weight, eps, residual, style)

    def rope_qk(self, q, k, cos, sin):
        self._fused.rope_qk(q, k, cos, sin)  # in place (q and k are views of this step's qkv output)
        return q, k

    def silu_and_mul(self, x):
        return self._fused.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x):
        return self._fused.gelu_tanh_and_mul(x)

    def swiglu_clamped(self, x, alpha, limit):
        return self._fused.swiglu_clamped(x, alpha, limit)

    def fused_experts(self, x, w13, w2, weights, ids, apply_weights_on_input=False, b13=None, b2=None,
                      activation=("silu",)):
        from pd_cluster.engine.attention.triton import fused_moe

        return fused_moe.fused_experts(x, w13, w2, weights, ids, apply_weights_on_input, b13=b13, b2=b2,
                                       activation=activation, fp8_activations=self.fp8_activations)

    def warm_up_experts(self, w13, w2, top_k, dtype, b13=None, b2=None, activation=("silu",)):
        from pd_cluster.engine.attention.triton import fused_moe

        fused_moe.warm_up(w13, w2, top_k, dtype, b13, b2, activation)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim // 2] (the "rotate half" / NeoX form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


TORCH_OPS = TorchLayerOps()


def torch_fused_experts(x: torch.Tensor, w13: torch.Tensor | QuantizedExperts, w2: torch.Tensor | QuantizedExperts,
                        weights: torch.Tensor, ids: torch.Tensor, ops: TorchLayerOps = TORCH_OPS,
                        apply_weights_on_input: bool = False, b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None, activation: tuple = ("silu",),
                        fp8_activations: bool = False) -> torch.Tensor:
    """The routed experts' output: ``sum_j weights[t, j] * down_e(act(gate_up_e(x[t])))`` with ``e = ids[t, j]``.

    Args:
        x: [T, H] activations.
        w13: [E, 2 I, H] gate rows then up rows of each (local) expert, x's dtype, or `QuantizedExperts`
            (FP8 blocks, MXFP4) of that shape: each used expert is dequantised into x's dtype when it runs, so
            the experts stay quantised in memory.
        w2: [E, H, I] down projections, plain or quantised like w13.
        weights: [T, k] float32 or x's dtype, from `select_experts`.
        ids: [T, k] local expert indices; -1 marks a choice another rank computes (contributes 0).
        ops: the activation (``silu_and_mul``, ``swiglu_clamped``).
        apply_weights_on_input: scale the expert's input instead of its output (Llama 4).
        b13, b2: [E, 2 I] and [E, H] biases of the two projections (gpt-oss), added after each product, or None.
        activation: ``("silu",)`` or ``("swiglu_clamped", alpha, limit)`` (`LayerOps.activation`).
        fp8_activations: with FP8 block weights, each GEMM's input is quantised per token group and dequantised
            first (`fake_quant_fp8_groups`): the W8A8 kernel's math. Off by default: the activations stay as
            they are, the math of the dequantised checkpoint.

    Returns:
        [T, H] in x's dtype. Each (token, choice) product is rounded to x's dtype before the k of
        a token are summed, as transformers' ``index_add_`` does.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    out = x.new_zeros(t * k, x.shape[1])
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=w13.shape[0]).tolist()  # w13: a tensor or quantised
    start = int((flat < 0).sum())  # the -1 entries sort first
    w = weights.reshape(-1)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start:start + n]
        start += n
        inp = x[rows // k]
        if apply_weights_on_input:
            inp = (inp * w[rows, None]).to(x.dtype)
        group = _fp8_group(w13) if fp8_activations else 0
        h = F.linear(fake_quant_fp8_groups(inp, group) if group else inp, expert_weight(w13, e, x.dtype))
        if b13 is not None:  # transformers adds the biases after the products (x @ W + b)
            h = h + b13[e]
        h = ops.activation(h, activation)
        h = F.linear(fake_quant_fp8_groups(h, group) if group else h, expert_weight(w2, e, x.dtype))
        if b2 is not None:
            h = h + b2[e]
        out[rows] = h if apply_weights_on_input else (h * w[rows, None]).to(x.dtype)
    return out.view(t, k, x.shape[1]).sum(dim=1)


def _fp8_group(w) -> int:
    """The activation columns per FP8 scale of the W8A8 kernel on experts `w`: the blocks' columns, a whole row
    for FP8 rows with per-token scales; 0 where the kernel does not quantise the input this way."""
    if not isinstance(w, QuantizedExperts):
        return 0
    if w.quant.format == "fp8_block":
        return w.quant.block[1]
    return 1 << 30 if w.quant.format == "fp8_rows" and w.quant.scheme.activations == "token" else 0


def layer_ops(name: str) -> TorchLayerOps:
    """``torch`` or ``triton``.

    Raises:
        ValueError: another name.
    """
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        return TritonLayerOps()
    raise ValueError(f"unknown layer ops {name!r}; choose torch or triton")
