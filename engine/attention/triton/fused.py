"""Fused element-wise kernels of the decoder layer: RMSNorm with the residual add, RoPE on q and k, the gated
activations (SiLU-and-mul, Gemma's GeLU(tanh)-and-mul, gpt-oss's clamped SwiGLU).

Unfused, these are ~30 small torch ops per layer (casts, pow, mean, rsqrt,
slices, cat), each a kernel launch and a round trip through memory. Each
function here is one launch and reads/writes its tensors once, as vLLM's and
SGLang's ``fused_add_rms_norm``, ``rotary_embedding`` and ``silu_and_mul`` do.
The torch ops in `pd_cluster.engine.model.layer_ops` / `rope` stay the reference
(`TorchLayerOps`); the arithmetic here follows them (float32 inside, rounding
to the activation dtype where the reference rounds), so fp32 results agree to
rounding and 16-bit ones to a unit in the last place.

Launches take no runtime-varying integer besides the grid: the token count
only sizes the grid, and row strides are fixed by the model's shapes, so each
kernel compiles one variant per (model, dtype) (see `pd_cluster.engine.attention.triton.variants`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pd_cluster.engine.attention.triton.common import next_pow2
from pd_cluster.engine.attention.triton.primitives import row_sum

SILU_BLOCK = 1024  # columns of the SiLU-and-mul output per program


NORM_STYLES = {"llama": 0, "gemma": 1, "float": 2}


@triton.jit
def _rms_norm_kernel(X, R, W, Y, R_out, stride_x, stride_r, stride_y, stride_ro, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STYLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the reference adds in the activation dtype: round the sum before normalising it
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(Y.dtype.element_ty)
        tl.store(R_out + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = row_sum(xf * xf) / N
    normed = xf * (1.0 / tl.sqrt(mean_sq + eps))[:, None]
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if STYLE == 1:  # Gemma: (1 + w) in float32, one rounding
        y = normed * (1.0 + w)
    elif STYLE == 2:  # gpt-oss: w in float32, one rounding
        y = w * normed
    else:  # Llama: round the normalised row first
        y = w * normed.to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             style: str = "llama") -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm (Zhang & Sennrich 2019) of ``x + residual``, in one launch.

    Args:
        x: [T, N] float16/bfloat16/float32, last dim contiguous.
        weight: [N], the norm's weight (cast to float32 inside).
        eps: the variance epsilon.
        residual: [T, N] like `x`, or None.
        style: how the weight applies, as `TorchLayerOps.rms_norm` (``llama``, ``gemma``, ``float``).

    Returns:
        (``weight * normalize(x + residual)`` [T, N] in x's dtype, the new residual
        ``x + residual`` [T, N] (None when `residual` is None)).
    """
    t, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    r_out = torch.empty((t, n), dtype=x.dtype, device=x.device) if residual is not None else None
    r = residual if residual is not None else x
    ro = r_out if r_out is not None else y
    if t:
        _rms_norm_kernel[(t,)](x, r, weight, y, ro, x.stride(0), r.stride(0), y.stride(0), ro.stride(0), eps,
                               N=n, BLOCK=next_pow2(n), HAS_RESIDUAL=residual is not None,
                               STYLE=NORM_STYLES[style], num_warps=_warps(n))
    return y, r_out


@triton.jit
def _rope_heads(X, row, stride_x_t, stride_x_h, c, s, H: tl.constexpr, BLOCK_H: tl.constexpr,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (d < HALF)
    p1 = X + row * stride_x_t + h * stride_x_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qk_kernel(Q, K, COS, SIN, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs,
                    HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(COS + row * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(SIN + row * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rope_heads(Q, row, stride_q_t, stride_q_h, c, s, HQ, BLOCK_HQ, HALF, BLOCK_HALF)
    _rope_heads(K, row, stride_k_t, stride_k_h, c, s, HK, BLOCK_HK, HALF, BLOCK_HALF)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k in place, rotate-half (NeoX) form, in one launch (Su et al. 2021).

    Args:
        q: [T, Hq, D], k: [T, Hk, D], float16/bfloat16/float32; the last dim contiguous
            (views into the fused qkv projection's output are fine).
        cos, sin: [T, D // 2], the step's table (`RotaryEmbedding.cos_sin`, any
            scaling type folded in), contiguous; float32 keeps the most precision.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"rope_qk needs an even head_dim with a contiguous last dim, got {tuple(q.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    if t:
        half = d // 2
        _rope_qk_kernel[(t,)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                              HQ=hq, HK=hk, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk),
                              HALF=half, BLOCK_HALF=next_pow2(half), num_warps=_warps(hq * d))


GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)
ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_CLAMPED = 0, 1, 2


@triton.jit
def _act_and_mul_kernel(X, Y, stride_x, stride_y, alpha, limit, N: tl.constexpr, BLOCK: tl.constexpr,
                        ACT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 2:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit); each op rounds there
        g = tl.minimum(gate, limit).to(Y.dtype.element_ty).to(tl.float32)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        sig = (1.0 / (1.0 + tl.exp(-(g * alpha).to(Y.dtype.element_ty).to(tl.float32))))
        glu = (g * sig.to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty).to(tl.float32)
        out = (u + 1.0).to(Y.dtype.element_ty).to(tl.float32) * glu
    else:
        if ACT == 1:  # gelu, tanh form: 0.5 g (1 + tanh(c (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
            z = tl.minimum(GELU_TANH_C * (gate + 0.044715 * gate * gate * gate), 20.0)  # tanh(20) is 1 in fp32
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        # the reference rounds act(gate) to the activation dtype before the product
        out = act.to(Y.dtype.element_ty).to(tl.float32) * up
    tl.store(Y + row * stride_y + cols, out.to(Y.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    t, two_n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = two_n // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(SILU_BLOCK, next_pow2(n))
        _act_and_mul_kernel[(t, triton.cdiv(n, block))](x, y, x.stride(0), y.stride(0), float(alpha), float(limit),
                                                        N=n, BLOCK=block, ACT=act, num_warps=_warps(block))
    return y


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``silu(x[:, :N]) * x[:, N:]`` in one launch.

    Args:
        x: [T, 2N] float16/bfloat16/float32 (the fused gate/up projection's output), last dim contiguous.

    Returns:
        [T, N] in x's dtype.
    """
    return _act_and_mul(x, ACT_SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Shazeer 2020) with the tanh form of GeLU, Gemma's ``gelu_pytorch_tanh``:
    ``gelu_tanh(x[:, :N]) * x[:, N:]`` in one launch; x and the result as `silu_and_mul`."""
    return _act_and_mul(x, ACT_GELU_TANH)


def swiglu_clamped(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation in one launch (`TorchLayerOps.swiglu_clamped`); x and the result as
    `silu_and_mul`."""
    return _act_and_mul(x, ACT_SWIGLU_CLAMPED, alpha, limit)


def _warps(elements: int) -> int:
    """4 warps up to 4k elements per program, 8 above (one row of Llama-3.1-8B's hidden size is 4096)."""
    return 4 if elements <= 4096 else 8
