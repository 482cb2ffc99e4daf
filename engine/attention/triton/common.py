"""Small helpers shared by the Triton attention kernels: dtype mapping, block sizes.

No kernel lives here; `store`, `decode` and `extend` hold one kernel family each.
"""

from __future__ import annotations

import torch
import triton.language as tl

FP8_E4M3_MAX = 448.0

_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def compute_dtype(dtype: torch.dtype):
    """The Triton dtype of the matrix products for activations of `dtype`.

    Raises:
        ValueError: `dtype` is not float16, bfloat16 or float32.
    """
    if dtype not in _COMPUTE:
        raise ValueError(f"Triton attention supports float16, bfloat16 and float32 activations, got {dtype}")
    return _COMPUTE[dtype]


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
