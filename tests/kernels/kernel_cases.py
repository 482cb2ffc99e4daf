"""Shared builders for the kernel tests: random pools, ragged batches, the float64 reference.

Error bounds are relative errors ``||out[i] - ref[i]|| / ||ref[i]||``, checked for every
row i (token or request) on its own, against the torch reference backend run in float64 on the same pool bytes. They follow the device
guide (/work/.library/device/METHOD.md, "Correct first"): float32 arithmetic
lands far under 1e-3; bf16 operands between 1e-3 and 1e-2. That guide gives no
figure for fp16; fp16 keeps 3 more mantissa bits than bf16 (unit roundoff
2**-11 against 2**-8), so its bound is the bf16 one divided by 4, which leaves
headroom over the 8x that the mantissa alone would give. NaN never passes.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.batch import ForwardBatch, build_forward_batch
from pd_cluster.engine.kv.pool import KVLayout, KVPool

REL_ERR_BOUND = {
    torch.float32: 1e-4,   # "far under 1e-3" (METHOD.md); the GPU path uses IEEE fp32 dots, not TF32
    torch.bfloat16: 1e-2,  # "bf16 operands between 1e-3 and 1e-2" (METHOD.md)
    torch.float16: 2.5e-3,  # bf16 bound / 4 (fp16: 3 more mantissa bits)
}

KV_DTYPE_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", "fp8": "fp8_e4m3"}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def row_rel_errs(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row relative errors ``||out[i] - ref[i]|| / ||ref[i]||`` (rows: the first dim) as float64 [rows].

    A row whose reference is all zero (a request with nothing to attend to) must
    be exactly zero: its error is its absolute norm. NaN anywhere gives NaN.
    """
    out, ref = out.double().reshape(out.shape[0], -1), ref.double().reshape(ref.shape[0], -1)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    diff = (out - ref).norm(dim=1)
    scale = ref.norm(dim=1)
    errs = torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)
    return torch.where(torch.isnan(out).any(dim=1), torch.full_like(errs, float("nan")), errs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's relative error (`row_rel_errs`): an error confined to a few rows (long
    requests beside many one-token ones) is not averaged away, as a whole-batch norm would.
    NaN in any row gives NaN (which fails every ``<=`` bound)."""
    errs = row_rel_errs(out, ref)
    if torch.isnan(errs).any():
        return float("nan")
    return float(errs.max()) if errs.numel() else 0.0


def make_pool(kv_dtype, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
              compute_dtype: torch.dtype, gen: torch.Generator, num_layers: int = 2,
              fp8_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> KVPool:
    """A pool whose every page (the null page too) holds random values.

    FP8 pools get per-layer scales other than 1.0, so that the scale folding is
    exercised (`fp8_scales` overrides them); the null page gets large values (8.0 before quantisation), so a
    kernel that attends to padding is visibly wrong.
    """
    name = KV_DTYPE_NAME[kv_dtype]
    fp8 = name == "fp8_e4m3"
    k_scales = tuple(0.5 + 0.25 * i for i in range(num_layers)) if fp8 else (1.0,) * num_layers
    v_scales = tuple(1.5 - 0.25 * i for i in range(num_layers)) if fp8 else (1.0,) * num_layers
    if fp8 and fp8_scales is not None:
        k_scales, v_scales = fp8_scales
    layout = KVLayout(num_layers, num_kv_heads, head_dim, page_size, name, k_scales, v_scales)
    pool = KVPool(layout, num_pages, device(), compute_dtype)
    slots = torch.arange(page_size, (num_pages + 1) * page_size, device=pool.device)
    shape = (slots.numel(), num_kv_heads, head_dim)
    for layer in range(num_layers):
        k = torch.randn(shape, generator=gen, dtype=torch.float32).to(pool.device)
        v = torch.randn(shape, generator=gen, dtype=torch.float32).to(pool.device)
        pool.store_kv(layer, k, v, slots)
        big = torch.full((page_size, num_kv_heads, head_dim), 8.0, device=pool.device)
        pool.store_kv(layer, big, -big, torch.arange(page_size, device=pool.device))  # the null page's slots
    return pool


def make_batch(specs: list[tuple[int, int]], num_decodes: int, page_size: int, num_pages: int,
               gen: torch.Generator) -> ForwardBatch:
    """A batch of requests ``(cached_len, new_len)``, decodes first, on scattered random pages.

    Raises:
        ValueError: the pool has too few pages for the specs.
    """
    perm = (torch.randperm(num_pages, generator=gen) + 1).tolist()
    tables, used = [], 0
    for cached, new in specs:
        need = -(-(cached + new) // page_size)
        if used + need > num_pages:
            raise ValueError(f"need more than {num_pages} pages")
        tables.append(perm[used:used + need])
        used += need
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    token_ids = [rng.integers(0, 512, size=new).astype(np.int64) for _, new in specs]
    rows = [np.array([new - 1]) for _, new in specs]
    return build_forward_batch(token_ids, [c for c, _ in specs], tables, rows, num_decodes, page_size, device())


def reference_attention(pool: KVPool, layer: int, q: torch.Tensor, batch: ForwardBatch, num_heads: int,
                        num_kv_heads: int, head_dim: int, scale: float,
                        sliding_window: int | None = None, spec=None, sinks: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """The torch reference backend's attention over `pool`'s current bytes, in float64.

    `spec` (a `LayerAttention`: window or chunk, sinks, softcapping) replaces `sliding_window` for every layer;
    `sinks` [num_heads] are the sink logits when the spec has sinks.

    The pool bytes are copied into a float64-compute pool; the reference's own
    store is pointed at the null page (slots -1), which no request attends to.

    Returns:
        [T, num_heads * head_dim] float64.
    """
    ref_pool = KVPool(pool.layout, pool.num_pages, pool.device, torch.float64)
    ref_pool.kv.copy_(pool.kv)
    layers = None if spec is None else (spec,) * pool.layout.num_layers
    ref = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale, sliding_window, layers=layers)
    t = q.shape[0]
    dummy = torch.zeros(t, num_kv_heads, head_dim, dtype=torch.float64, device=q.device)
    no_store = dataclasses.replace(batch, slot_mapping=torch.full_like(batch.slot_mapping, -1))
    return ref.forward(layer, q.double(), dummy, dummy, ref_pool, no_store,
                       sinks=None if sinks is None else sinks.double())


def random_q(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device=device(), dtype=dtype)


def kernel_grid(*axes: dict) -> list:
    """pytest params over `axes` (each ``{id: value}``, in the test's argument order; a tuple value fills several
    arguments): on a CUDA device every combination, under Triton's interpreter (CPU) a pairwise covering set.

    The interpreter runs each program of a launch in Python, so a full grid of 3 x 3 x 2 x 2 launches costs
    minutes of CPU; the covering set keeps every value of every axis and every pair of values of two axes (page
    size with GQA ratio, activation dtype with KV dtype, ...) together in at least one case, chosen greedily and
    in a fixed order, so the same cases run every time. Each case keeps its full check.
    """
    rows = list(itertools.product(*(list(a.items()) for a in axes)))
    if not torch.cuda.is_available():
        rows = _pairwise_cover(rows)
    return [pytest.param(*(v for _, value in row for v in (value if isinstance(value, tuple) else (value,))),
                         id="-".join(name for name, _ in row)) for row in rows]


def _pairwise_cover(rows: list[tuple]) -> list[tuple]:
    """The greedy covering set of `rows` (a full product of ``(id, value)`` axes): repeatedly the first row that
    covers the most pairs of (axis, id) not yet covered, until every pair is."""
    def pairs(row):
        return {(i, row[i][0], j, row[j][0]) for i, j in itertools.combinations(range(len(row)), 2)}

    uncovered = set().union(*(pairs(r) for r in rows))
    chosen = []
    while uncovered:
        best = max(rows, key=lambda r: len(pairs(r) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen
