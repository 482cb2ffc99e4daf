"""The element-wise ops of a decoder layer, behind one small interface: torch (the reference) or fused Triton.

`LayerOps` has three ops, each the unit vLLM and SGLang fuse into one kernel:

* ``rms_norm(x, weight, eps, residual)``: RMSNorm of ``x + residual``; returns the
  normalised rows and the new residual (the pre-norm residual stream never
  materialises as a separate add);
* ``rope_qk(q, k, cos, sin)``: RoPE on q and k;
* ``silu_and_mul(x)``: SwiGLU's activation over the fused gate/up output;
* ``fused_experts(x, w13, w2, weights, ids)``: a mixture-of-experts layer's routed experts
  (`pd_cluster.engine.model.moe`; Triton: tokens sorted by expert, grouped GEMMs).

`TorchLayerOps` is the reference and runs anywhere. `TritonLayerOps` launches
one kernel per op (`pd_cluster.engine.attention.triton.fused`); the model uses it
with the triton attention backend (`LlamaForCausalLM.set_layer_ops`). Under
``TRITON_INTERPRET=1`` it runs on CPU, which is how CI checks it.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


class TorchLayerOps:
    """The reference: plain torch ops, the math of HF's Llama."""

    name = "torch"

    def cos_sin_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the step's cos/sin table: the activation dtype, as HF Llama does."""
        return act_dtype

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``weight * normalize(x + residual)``, ``x + residual`` or None); x [T, N], computed in float32."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype), residual

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] rotated by cos/sin [T, D // 2] (rotate-half form); new tensors."""
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :N]) * x[:, N:]`` for x [T, 2N]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, apply_weights_on_input: bool = False) -> torch.Tensor:
        """Routed experts' output [T, H] (`pd_cluster.engine.model.moe.torch_fused_experts`: shapes, -1 ids)."""
        from pd_cluster.engine.model.moe import torch_fused_experts  # moe imports this module

        return torch_fused_experts(x, w13, w2, weights, ids, self, apply_weights_on_input)

    def warm_up_experts(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype) -> None:
        """Compile what a start-up step does not (nothing to compile here)."""


class TritonLayerOps(TorchLayerOps):
    """One Triton launch per op; float32 cos/sin (the kernel computes in float32 anyway)."""

    name = "triton"

    def __init__(self) -> None:
        from pd_cluster.engine.attention.triton import fused  # imported here: torch-only installs never need triton

        self._fused = fused

    def cos_sin_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def rms_norm(self, x, weight, eps, residual=None):
        return self._fused.rms_norm(x, weight, eps, residual)

    def rope_qk(self, q, k, cos, sin):
        self._fused.rope_qk(q, k, cos, sin)  # in place (q and k are views of this step's qkv output)
        return q, k

    def silu_and_mul(self, x):
        return self._fused.silu_and_mul(x)

    def fused_experts(self, x, w13, w2, weights, ids, apply_weights_on_input=False):
        from pd_cluster.engine.attention.triton import fused_moe

        return fused_moe.fused_experts(x, w13, w2, weights, ids, apply_weights_on_input)

    def warm_up_experts(self, w13, w2, top_k, dtype):
        from pd_cluster.engine.attention.triton import fused_moe

        fused_moe.warm_up(w13, w2, top_k, dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim // 2] (the "rotate half" / NeoX form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


TORCH_OPS = TorchLayerOps()


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
