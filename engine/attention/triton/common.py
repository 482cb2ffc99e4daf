"""Small helpers shared by the Triton attention kernels: dtype mapping, block sizes.

No kernel lives here; `store`, `decode` and `extend` hold one kernel family each.
"""

from __future__ import annotations

import torch
import triton.language as tl

FP8_E4M3_MAX = 448.0
FP16_MAX = 65504.0

_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def compute_dtype(dtype: torch.dtype):
    """The Triton dtype of the matrix products for activations of `dtype`.

    Raises:
        ValueError: `dtype` is not float16, bfloat16 or float32.
    """
    if dtype not in _COMPUTE:
        raise ValueError(f"Triton attention supports float16, bfloat16 and float32 activations, got {dtype}")
    return _COMPUTE[dtype]


def dot_dtype(act: torch.dtype, kv: torch.dtype):
    """The operand dtype of the attention `tl.dot`s for activations `act` over pages of `kv`.

    float32 activations: float32 (IEEE). FP8 pages under 16-bit activations:
    float16, because Hopper converts E4M3 to fp16 in one instruction per pair
    while bf16 needs a second per element (seen in the sm_90 SASS of the decode
    kernel: one F2F.BF16.F16 per element); the FP8 values are exact in fp16 and
    bf16 queries keep their 8-bit mantissa (they are clamped to the fp16 range).
    Otherwise the activation dtype.

    Raises:
        ValueError: unsupported activation dtype.
    """
    if compute_dtype(act) == tl.float32:
        return tl.float32
    if kv == torch.float8_e4m3fn:
        return tl.float16
    return compute_dtype(act)


def dot_precision(dtype: torch.dtype) -> str:
    """``ieee`` for float32 activations (no silent TF32), ``tf32`` otherwise (unused for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def head_block(head_dim: int) -> int:
    """The padded head dimension: a power of two and at least 16 (the smallest `tl.dot` side)."""
    return max(16, next_pow2(head_dim))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
