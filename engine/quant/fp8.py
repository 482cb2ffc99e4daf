"""FP8 E4M3 weights and activations: dequantisation, activation quantisation, and the W8A8 reference math.

Weights are ``float8_e4m3fn`` [N, K] with float32 scales, the true weight being ``w[i, j] * scale``:

* blocks (DeepSeek-V3's ``weight_scale_inv``, compressed-tensors' ``block``): scale [ceil(N / bn), ceil(K / bk)],
  ``w[i, j] * scale[i // bn, j // bk]``;
* rows (per channel, and per tensor, whose one scale is repeated per row so that fused q/k/v keep theirs):
  scale [N], ``w[i, j] * scale[i]``.

Activations (the GPU path's W8A8; DeepSeek-V3's ``act_quant``, vLLM's ``per_token_group_quant_fp8`` and
``scaled_fp8_quant``): each token's values in groups of ``group`` columns (a whole row per token: ``group = K``)
are divided by ``scale = max(amax, eps) / 448`` (``amax`` capped by fbgemm's ``activation_scale_ub``) and cast to
E4M3 after clamping to +-448 (PyTorch's cast does not saturate). `w8a8_reference` is the W8A8 product the Triton
kernel (`pd_cluster.engine.attention.triton.fp8_gemm`) and ``torch._scaled_mm`` compute, in float32.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_EPS = 1e-10  # vLLM's and SGLang's floor on an activation group's amax


def scale_rows(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """A block scale's rows repeated to one per weight row: [ceil(N / bn), C] -> [N, C]."""
    return scale.repeat_interleave(block_rows, dim=0)[:rows]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The true values of FP8 weight rows, computed in float32 and rounded once to `dtype`.

    Args:
        weight: [n, K] float8_e4m3fn.
        scale: blocks: [ceil(n / bn), ceil(K / bk)] float32; rows (`block` None): [n] float32.
        block: (bn, bk), or None for one scale per row.
        dtype: the result's dtype.

    Returns:
        [n, K] `dtype`.

    Raises:
        ValueError: `scale`'s shape does not fit `weight`.
    """
    n, k = weight.shape
    if block is None:
        if tuple(scale.shape) != (n,):
            raise ValueError(f"a per-row FP8 scale of shape {tuple(scale.shape)} for a {n}x{k} weight (expected ({n},))")
        return (weight.float() * scale.float()[:, None]).to(dtype)
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"an FP8 block scale of shape {tuple(scale.shape)} does not tile a {n}x{k} weight in "
                         f"{bn}x{bk} blocks (expected {want})")
    full = scale_rows(scale.float(), n, bn).repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * full).to(dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, +-448)`` as float8_e4m3fn (`scale` broadcast against `x`, float32 math)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activations(x: torch.Tensor, group: int, scale_ub: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantisation per token and group of `group` columns (a whole row when ``group >= K``).

    Args:
        x: [M, K] float16/bfloat16/float32.
        group: columns per scale.
        scale_ub: cap on each group's amax (fbgemm_fp8's ``activation_scale_ub``), None for none.

    Returns:
        (x_q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32); ``x ~ x_q * scales`` per group.
    """
    m, k = x.shape
    group = min(group, k)
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1).clamp(min=SCALE_EPS)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scales = amax / FP8_MAX
    q = quantize_fp8(padded, scales[..., None]).view(m, groups * group)[:, :k]
    return q, scales


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   act_group: int | None, act_scale: torch.Tensor | None = None, scale_ub: float | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` the W8A8 way: x quantised to FP8 (dynamically per token and `act_group` columns, or with the
    static scalar `act_scale`), both operands dequantised, the product summed in float32 and rounded to `dtype`.

    Args:
        x: [M, K] activations.
        weight, scale, block: as `dequantize_fp8`.
        act_group: activation columns per dynamic scale (``block[1]``; K per token); None with `act_scale`.
        act_scale: a static float32 scalar, or None.
        scale_ub: as `quantize_activations`.
        dtype: the result's dtype (default x's).

    Returns:
        [M, N] `dtype`.
    """
    if act_scale is not None:
        xq = quantize_fp8(x, act_scale.float()).float() * act_scale.float()
    else:
        group = min(act_group or x.shape[1], x.shape[1])
        q, s = quantize_activations(x, group, scale_ub)
        xq = q.float() * s.repeat_interleave(group, dim=1)[:, :x.shape[1]]
    return (xq @ dequantize_fp8(weight, scale, block).t()).to(dtype or x.dtype)


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [N, K] float weights to FP8 with one scale per block (``max |w| / 448``; a zero block gets 1).
    Used to build test checkpoints in the release formats and by the GPU benchmark.

    Returns:
        (weight [N, K] float8_e4m3fn, scale [ceil(N / bn), ceil(K / bk)] float32).
    """
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    tiles = padded.view(rows, bn, cols, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = quantize_fp8(tiles, scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k]
    return q.contiguous(), scale


def quantize_weight_rows(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [N, K] float weights to FP8 with one scale per row (or one for the whole tensor).

    Returns:
        (weight [N, K] float8_e4m3fn, scale float32: [N, 1] per row, [1] per tensor).
    """
    amax = w.float().abs().amax() if per_tensor else w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return quantize_fp8(w, scale), scale.reshape(1) if per_tensor else scale
