"""MXFP4: 4-bit E2M1 values in blocks of 32 along the reduction axis, one E8M0 power-of-two scale per block.

The OCP Microscaling Formats (MX) specification v1.0 defines the format; gpt-oss's release stores its experts in
it (``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``). A weight ``W`` [N, K]
(``K`` the reduction axis: nn.Linear's ``in_features``) is stored as

* ``<name>_blocks`` [N, K / 32, 16] uint8: each byte holds two E2M1 codes, the element of even index ``2j`` in
  its low nibble and ``2j + 1`` in its high nibble (transformers' ``convert_moe_packed_tensors`` reads
  ``blocks & 0x0F`` into the even columns, ``blocks >> 4`` into the odd ones; OpenAI's ``triton_kernels`` packs
  the same way);
* ``<name>_scales`` [N, K / 32] uint8: E8M0 exponents, the block's scale is ``2 ** (code - 127)`` (code 255 is
  NaN in the spec; it never occurs in a release).

An E2M1 code is ``s e1 e0 m`` (sign, two exponent bits with bias 1, one mantissa bit): the magnitudes of codes
0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 are their negatives. A value is ``E2M1[code] * scale``,
exactly representable in float32 and bfloat16 (two significant bits).

gpt-oss's experts are stacked: ``gate_up_proj_blocks`` [E, 2 I, H / 32, 16] (rows interleaved: gate row ``j`` at
``2 j``, up row ``j`` at ``2 j + 1``), ``down_proj_blocks`` [E, H, I / 32, 16], with ``*_scales`` [E, N, K / 32]
beside them; dequantised and transposed they are transformers' ``gate_up_proj`` [E, H, 2 I] and ``down_proj``
[E, I, H] (``x @ W`` form).

`quantize_mxfp4` chooses each block's scale as the smallest power of two that keeps the block's largest magnitude
within 6 (no element saturates; ``triton_kernels``' round-up mode) and rounds to the nearest E2M1 value, ties to
the even code, as the spec's conversion does.
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Elements per MXFP4 block (along the reduction axis)."""
BYTES_PER_BLOCK = BLOCK // 2
SCALE_BIAS = 127
"""The E8M0 scale ``code`` means ``2 ** (code - SCALE_BIAS)``."""
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code."""
# Between magnitude codes j and j + 1 (their midpoint) a tie goes to the even code: down after an even j, up after
# an odd one.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis, the even element in the low nibble.

    Args:
        codes: [..., K] integer codes in ``[0, 16)``, K even.

    Returns:
        [..., K / 2] uint8.

    Raises:
        ValueError: an odd last axis.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"MXFP4 packs codes in pairs; the last axis has {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_e2m1`: [..., K / 2] uint8 -> [..., K] uint8 codes."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) as float32 powers of two, ``2 ** (code - 127)`` (exact: ``torch.ldexp``)."""
    return torch.ldexp(torch.ones(scales.shape, dtype=torch.float32, device=scales.device),
                       scales.to(torch.int32) - SCALE_BIAS)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of an MXFP4 tensor.

    Args:
        blocks: [..., N, K / 32, 16] uint8 as released, or the same bytes as [..., N, K / 2].
        scales: [..., N, K / 32] uint8 E8M0 codes.
        dtype: the result's dtype (float32 and bfloat16 hold every value exactly).

    Returns:
        [..., N, K] of `dtype`.

    Raises:
        ValueError: shapes that do not pair one scale with each block of 32.
    """
    packed = blocks.reshape(*blocks.shape[:-2], -1) if blocks.dim() == scales.dim() + 1 else blocks
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * BYTES_PER_BLOCK:
        raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of shape "
                         f"{tuple(scales.shape)} (one scale per {BLOCK} values, {BYTES_PER_BLOCK} bytes)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[unpack_e2m1(packed).long()]
    values = values.view(*scales.shape, BLOCK) * e8m0_to_float(scales).unsqueeze(-1)
    return values.reshape(*packed.shape[:-1], -1).to(dtype)


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes of the E2M1 values nearest to x (float32, already within [-6, 6]), ties to the even code."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for j, mid in enumerate(_MIDPOINTS):
        code += (mag > mid if j % 2 == 0 else mag >= mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `w` [..., N, K] (K a multiple of 32) into the release layout.

    Returns:
        (blocks [..., N, K / 32, 16] uint8, scales [..., N, K / 32] uint8); `dequantize_mxfp4` of them is the
        quantised value of every element.

    Raises:
        ValueError: K is not a multiple of 32.
    """
    k = w.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MXFP4 quantises the reduction axis in blocks of {BLOCK}; it has {k} elements")
    tiles = w.float().reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # the smallest s with amax <= 6 * 2**s: s = exponent - 3 when mantissa <= 0.75, else exponent - 2
    shared = torch.where(mantissa <= 0.75, exponent - 3, exponent - 2)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -SCALE_BIAS)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = torch.ldexp(tiles, -shared.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _nearest_e2m1(scaled)
    blocks = pack_e2m1(codes.reshape(*w.shape[:-1], k)).reshape(*w.shape[:-1], k // BLOCK, BYTES_PER_BLOCK)
    return blocks, (shared + SCALE_BIAS).to(torch.uint8)
