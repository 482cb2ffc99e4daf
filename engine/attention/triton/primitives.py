"""Row reductions for the kernels, built on `tl.reduce` (a Triton builtin).

Triton's own ``tl.sum``, ``tl.max``, ``tl.zeros`` and ``tl.cdiv`` are
``@triton.jit`` functions of its standard library, decorated once when
``triton`` is first imported. In a process that imported ``triton`` before
``TRITON_INTERPRET=1`` was set (transformers does, through torch._dynamo)
they stay compiled-mode functions and the interpreter refuses to call them.
The kernels therefore use only builtins and the helpers below, which are
decorated when this package loads, after `engine.attention.triton` has set
the variable on machines without CUDA. The generated code is the same
reduction either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def row_max(x):
    """Max over axis 1 of a 2-D float32 block."""
    return tl.reduce(x, 1, _max_combine)


@triton.jit
def row_sum(x):
    """Sum over axis 1 of a 2-D float32 block."""
    return tl.reduce(x, 1, _add_combine)
