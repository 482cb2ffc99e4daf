"""The GPU path of `QuantLinear`: which kernel computes each scheme (`pd_cluster.engine.quant.linear` says how
it compares with the reference path).

* FP8 in blocks: activations quantised per token and block column (`fp8_gemm.quantize_activations`), then the
  Triton block GEMM (`fp8_gemm.fp8_gemm`), as vLLM's and SGLang's ``w8a8_block_fp8_matmul``.
* FP8 per channel or per tensor (held as one scale per row): activations quantised per token (dynamic, capped by
  fbgemm's ``activation_scale_ub``), per step (``tensor``) or with the static ``input_scale``, then
  ``torch._scaled_mm`` with rowwise scales on Hopper (cuBLASLt; bf16 output, K and N multiples of 16), else the
  same Triton kernel.
* FP8 weight-only (W8A16) and int4 (W4A16): the Triton kernels dequantise in the tile (`int4_gemm.int4_gemm`).

Triton is imported here only (a CPU install without it never reaches this module).
"""

from __future__ import annotations

import torch

from pd_cluster.engine.attention.triton.fp8_gemm import fp8_gemm, quantize_activations
from pd_cluster.engine.attention.triton.int4_gemm import int4_gemm
from pd_cluster.engine.quant.fp8 import FP8_MAX, SCALE_EPS, quantize_fp8
from pd_cluster.engine.quant.weight_scheme import INT4


def quant_linear(layer, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
    """`layer` (a `pd_cluster.engine.quant.linear.QuantLinear`, which calls this) applied to x [..., K] through the
    kernels: [..., N] in x's dtype (without the bias if not `add_bias`)."""
    k, n = layer.in_features, layer.out_features
    x2 = x.reshape(-1, k)
    s = layer.scheme
    bias = layer.bias if add_bias else None
    if s.kind == INT4:
        out = int4_gemm(x2, layer.qweight, layer.scales, layer.zeros, layer.g_idx, s.group_size, bias)
    else:
        out = _fp8_linear(layer, x2, bias)
    return out.view(*x.shape[:-1], n)


def _fp8_linear(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    s, k = layer.scheme, layer.in_features
    if s.activations == "none":
        return fp8_gemm(x, None, k, layer.weight, layer.weight_scale, s.block, x.dtype, bias)
    if s.activations == "static":
        a_scale, group = layer.input_scale, k
        a = quantize_fp8(x, a_scale)
    elif s.activations == "tensor":
        a_scale = (x.abs().amax().float().clamp(min=SCALE_EPS) / FP8_MAX).reshape(1)
        a, group = quantize_fp8(x, a_scale), k
    else:
        group = s.block[1] if s.activations == "group" else k
        a, a_scale = quantize_activations(x, group, s.activation_scale_ub)
    if s.block is None and _scaled_mm_fits(x, layer):
        rows = a_scale.reshape(-1, 1).expand(x.shape[0], 1).contiguous() if a_scale.dim() < 2 or a_scale.shape[0] == 1 \
            else a_scale
        out = torch._scaled_mm(a, layer.weight.t(), scale_a=rows, scale_b=layer.weight_scale.view(1, -1),
                               out_dtype=x.dtype)
        return out if bias is None else out + bias
    return fp8_gemm(a, a_scale, group, layer.weight, layer.weight_scale, s.block, x.dtype, bias)


def _scaled_mm_fits(x: torch.Tensor, layer) -> bool:
    """Whether ``torch._scaled_mm``'s rowwise FP8 GEMM takes this case (CUDA sm_89+, bf16 out, K, N % 16)."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9) and x.dtype == torch.bfloat16
            and layer.in_features % 16 == 0 and layer.out_features % 16 == 0)
