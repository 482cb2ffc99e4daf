"""Row reductions for the kernels, built on `tl.reduce` (a Triton builtin), the GEMMs' grouped tile order, and
the int4 weight tile that the W4A16 GEMM and the fused MoE kernel dequantise.

Triton's own ``tl.sum``, ``tl.max``, ``tl.zeros`` and ``tl.cdiv`` are
``@triton.jit`` functions of its standard library, decorated once when
``triton`` is first imported. In a process that imported ``triton`` before
``TRITON_INTERPRET=1`` was set (transformers does, through torch._dynamo)
they stay compiled-mode functions and the interpreter refuses to call them.
The kernels therefore call `tl.reduce` directly. Its combine functions are
Triton's own (``_elementwise_max``, ``_sum_combine``): the compiler emits the
same code as for ``tl.max``/``tl.sum``, and the interpreter recognises them
and reduces with numpy, never calling them (a combine function of our own
would be run element by element in Python, several times slower). If a
Triton release drops those names, our own combine functions are used.
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


try:
    from triton.language.standard import _elementwise_max as MAX_COMBINE
    from triton.language.standard import _sum_combine as SUM_COMBINE
except ImportError:  # pragma: no cover - depends on the Triton release
    MAX_COMBINE, SUM_COMBINE = _max_combine, _add_combine


@triton.jit
def row_max(x):
    """Max over axis 1 of a 2-D float32 block."""
    return tl.reduce(x, 1, MAX_COMBINE)


@triton.jit
def row_sum(x):
    """Sum over axis 1 of a 2-D float32 block."""
    return tl.reduce(x, 1, SUM_COMBINE)


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """The (row tile, column tile) of program `pid` among `num_m` x `num_n` output tiles, launched GROUP_M row
    tiles at a time so consecutive programs reuse the same weight columns from L2 (Triton's matmul tutorial,
    "L2 cache optimizations")."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_size, (pid % in_group) // group_size


@triton.jit
def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of an [M, N] GEMM (`grouped_tile` order): its rows [BLOCK_M] and columns
    [BLOCK_N] as int64 indices, and their masks (``rows < M``, ``cols < N``)."""
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return rows, cols, rows < M, cols < N


@triton.jit
def int4_tile(QW, SC, ZR, GIDX, stride_qk, stride_sg, k, k_mask, cols, mask, GROUP_SIZE: tl.constexpr,
              HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr):
    """[BLOCK_K, BLOCK_N] float32 values ``(q - z[g]) * s[g]`` of int4 weights in the engine's layout
    (`pd_cluster.engine.quant.int4`): rows `k` (input columns) and columns `cols` (outputs) of ``qweight``
    [K / 8, N] int32 at `QW` (nibble ``k % 8`` of word row ``k // 8``), scales and zero points [G, N] at `SC`
    and `ZR` (8 without zeros; both contiguous, one row stride), each column's group ``k // GROUP_SIZE`` or
    ``g_idx[k]`` at `GIDX`; `mask` ([BLOCK_K, BLOCK_N]) and `k_mask` ([BLOCK_K]) mark the tile's valid part."""
    packed = tl.load(QW + (k // 8)[:, None].to(tl.int64) * stride_qk + cols[None, :], mask=mask, other=0)
    q = ((packed >> ((k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    if HAS_GIDX:
        g = tl.load(GIDX + k, mask=k_mask, other=0).to(tl.int64)
    else:
        g = (k // GROUP_SIZE).to(tl.int64)
    s = tl.load(SC + g[:, None] * stride_sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(ZR + g[:, None] * stride_sg + cols[None, :], mask=mask, other=8).to(tl.float32)
    else:
        z = 8.0
    return (q - z) * s
