"""Attention microbenchmarks of the GPU benchmark: FP8 paged decode, and the 8k-token prefill kernel.

Decode, at Llama-3.1-8B's per-layer shapes (32 query heads, 8 KV heads,
head_dim 128) over one layer of an FP8 E4M3 pool with page size 64 and pages
scattered at random: the Triton kernels, the torch reference backend on the
same pool, and `torch.nn.functional.scaled_dot_product_attention` over the same
K and V laid out contiguously in bf16. Bytes counted: each K/V byte read once,
plus queries, outputs and block tables. FlashInfer's paged decode, when it is
installed, runs on the same pool and batches (`gpu_flashinfer`).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import torch
import torch.nn.functional as F

from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, pct
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton.decode import (DecodeKernelConfig, DecodeWorkspace, decode_attention, max_splits_for,
                                            num_kv_splits)
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig, extend_attention
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVLayout, KVPool

PAGE = 64
K_SCALE, V_SCALE = 0.05, 0.04


@dataclasses.dataclass(frozen=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


def make_fp8_pool(shape: Shape, num_pages: int, device: torch.device) -> KVPool:
    """One layer of FP8 pages filled with random codes (no NaN codes), written a few pages at a time."""
    layout = KVLayout(1, shape.num_kv_heads, shape.head_dim, PAGE, "fp8_e4m3", (K_SCALE,), (V_SCALE,))
    pool = KVPool(layout, num_pages, device, torch.bfloat16)
    step = 4096
    for lo in range(0, num_pages + 1, step):
        chunk = pool.kv[lo:lo + step]
        chunk.copy_(torch.randn(chunk.shape, device=device).to(torch.float8_e4m3fn).view(torch.uint8))
    return pool


def decode_batch(bsz: int, ctx: int, num_pages: int, device: torch.device, gen: torch.Generator) -> ForwardBatch:
    """`bsz` requests decoding at position ``ctx - 1`` on distinct random pages."""
    per = -(-ctx // PAGE)
    pages = (torch.randperm(num_pages, generator=gen)[:bsz * per] + 1).view(bsz, per).to(torch.int32)
    return batch_from_tables(pages, [ctx] * bsz, device)


def batch_from_tables(block_tables: torch.Tensor, seq_lens: list[int], device: torch.device) -> ForwardBatch:
    """A decode-only batch (one query per request) over the given [B, W] page ids, padded with page 0."""
    bsz = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    pos = seq.long() - 1
    slots = torch.full((bsz,), -1, dtype=torch.long)  # the benchmarks attend only
    qsl = torch.arange(bsz + 1, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.zeros(bsz, dtype=torch.long, device=device), positions=pos.to(device),
        slot_mapping=slots.to(device), query_start_loc=qsl.to(device), seq_lens=seq.to(device),
        block_tables=block_tables.to(device=device, dtype=torch.int32), logits_indices=torch.arange(bsz, device=device),
        num_decodes=bsz, query_lens_cpu=[1] * bsz, seq_lens_cpu=list(seq_lens), query_start_loc_cpu=qsl.tolist())


def _triton_decode_fn(q, pool, batch, shape: Shape, cfg: DecodeKernelConfig, num_sms: int):
    bsz = q.shape[0]
    s = max_splits_for(bsz, shape.num_kv_heads, num_sms, cfg)
    ws = DecodeWorkspace(num_kv_splits(batch.seq_lens, s, cfg),
                         torch.empty(bsz, shape.num_heads, s, shape.head_dim, device=q.device),
                         torch.empty(bsz, shape.num_heads, s, device=q.device), s)
    out = torch.empty_like(q)
    k_cache, v_cache = pool.layer_cache(0)
    scale = shape.head_dim ** -0.5

    def run():
        decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, out, ws, scale,
                         K_SCALE, V_SCALE, cfg)
    return run


def decode_bytes(bsz: int, ctx: int, shape: Shape, kv_elem: int) -> int:
    kv = 2 * bsz * ctx * shape.num_kv_heads * shape.head_dim * kv_elem
    q_out = 2 * bsz * shape.num_heads * shape.head_dim * 2
    return kv + q_out + bsz * (-(-ctx // PAGE)) * 4


def tune_decode(device, num_sms: int, smoke: bool) -> tuple[DecodeKernelConfig, Section]:
    """Time a few launch configurations at batch 32, context 4k (the target point) and keep the fastest."""
    shape = Shape() if not smoke else Shape(4, 2, 32)
    bsz, ctx = (32, 4096) if not smoke else (2, 128)
    pool = make_fp8_pool(shape, bsz * ctx // PAGE + 8, device)
    batch = decode_batch(bsz, ctx, pool.num_pages, device, torch.Generator().manual_seed(0))
    q = torch.randn(bsz, shape.num_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    # warps=2 with block_n >= 64 spills registers on sm_90 (bench/scripts/gpu_compile.py), so it is left out
    # six points around the sm_90 compile report's picks (each costs a compile, a few seconds on a first run)
    grid = [(64, 4, 2)] if smoke else [(32, 2, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2)]
    sec = Section(f"Decode kernel launch settings (batch {bsz}, context {ctx}, FP8)",
                  ["block_n", "num_warps", "num_stages", "time (us)", "GB/s"])
    best = None
    for bn, nw, ns in grid:
        cfg = DecodeKernelConfig(block_n=bn, num_warps=nw, num_stages=ns)
        try:
            ms = bench_ms(_triton_decode_fn(q, pool, batch, shape, cfg, num_sms), device)
        except Exception as e:  # a configuration that does not compile (e.g. out of shared memory)
            sec.rows.append(Row([bn, nw, ns, "failed", repr(e)[:120]]))
            print(f"decode config {cfg} failed: {e!r}", file=sys.stderr)
            continue
        gbps = decode_bytes(bsz, ctx, shape, 1) / (ms * 1e-3) / 1e9
        sec.rows.append(Row([bn, nw, ns, ms * 1e3, gbps]))
        if best is None or ms < best[0]:
            best = (ms, cfg)
    cfg = best[1]
    for pps in (2, 8, 16) if not smoke else ():  # split sizing: programs per SM (default 4)
        trial = dataclasses.replace(cfg, programs_per_sm=pps)
        ms = bench_ms(_triton_decode_fn(q, pool, batch, shape, trial, num_sms), device)
        sec.rows.append(Row([f"{cfg.block_n} (programs_per_sm={pps})", cfg.num_warps, cfg.num_stages, ms * 1e3,
                             decode_bytes(bsz, ctx, shape, 1) / (ms * 1e-3) / 1e9]))
        if ms < best[0]:
            best = (ms, trial)
    cfg = best[1]
    sec.notes.append(f"kept: block_n={cfg.block_n}, num_warps={cfg.num_warps}, num_stages={cfg.num_stages}, "
                     f"programs_per_sm={cfg.programs_per_sm}")
    return cfg, sec


SWEEP_SHAPES = ((32, 4096), (64, 2048), (128, 1024), (128, 4096))
SWEEP_CONFIGS = ((32, 2, 2), (32, 4, 3), (64, 4, 2), (64, 8, 3), (128, 8, 2), (128, 4, 2))
SWEEP_PPS = (2, 4, 8, 16)


def decode_sweep(device, ceil: Ceilings, num_sms: int, smoke: bool) -> Section:
    """Launch settings x split sizing at several (batch, context) points: which setting is best where.

    One pool (the largest point's size, pages scattered at random) serves every point. Each cell is the
    time and the % of the measured copy bandwidth; the best cell of each point is marked.
    """
    shape = Shape() if not smoke else Shape(4, 2, 32)
    shapes = SWEEP_SHAPES if not smoke else ((2, 128),)
    configs = SWEEP_CONFIGS if not smoke else ((64, 4, 2),)
    pps_values = SWEEP_PPS if not smoke else (4,)
    pool = make_fp8_pool(shape, max(b * c for b, c in shapes) // PAGE + 8, device)
    gen = torch.Generator().manual_seed(2)
    sec = Section("Decode kernel sweep: launch settings x programs per SM (FP8, Llama-3.1-8B shapes)",
                  ["batch", "context", "block_n", "num_warps", "num_stages", "programs_per_sm", "splits",
                   "time (us)", "% of copy BW", "best"])
    for bsz, ctx in shapes:
        batch = decode_batch(bsz, ctx, pool.num_pages, device, gen)
        q = torch.randn(bsz, shape.num_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
        nbytes = decode_bytes(bsz, ctx, shape, 1)
        rows = []
        for (bn, nw, ns), pps in itertools.product(configs, pps_values):
            cfg = DecodeKernelConfig(block_n=bn, num_warps=nw, num_stages=ns, programs_per_sm=pps)
            splits = max_splits_for(bsz, shape.num_kv_heads, num_sms, cfg)
            try:
                ms = bench_ms(_triton_decode_fn(q, pool, batch, shape, cfg, num_sms), device, rep_ms=100)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a row, not a stop
                rows.append(Row([bsz, ctx, bn, nw, ns, pps, splits, "failed", repr(e)[:60], ""]))
                continue
            rows.append(Row([bsz, ctx, bn, nw, ns, pps, splits, ms * 1e3,
                             pct(nbytes / (ms * 1e-3) / 1e9, ceil.copy_gbps), ""]))
        timed = [r for r in rows if isinstance(r.cells[7], float)]
        if timed:
            min(timed, key=lambda r: r.cells[7]).cells[9] = "best"
        sec.rows += rows
    sec.notes.append("splits = the grid's split axis for the batch (`max_splits_for`); each request also needs "
                     "256 tokens per split (`min_tokens_per_split`).")
    return sec


def decode_table(device, ceil: Ceilings, cfg: DecodeKernelConfig, num_sms: int, smoke: bool,
                 companion=None) -> Section:
    """The decode attention table; `companion` (e.g. `gpu_flashinfer.FlashInferDecode`) gets each shape too.

    The companion's ``prepare(pool, shape)`` runs once on the pool, then ``add(bsz, ctx, batch, q, triton_ms)``
    after the Triton kernel is timed on each (batch, context), with the same pages and queries.
    """
    shape = Shape() if not smoke else Shape(4, 2, 32)
    batches, ctxs = ((1, 32, 128), (1024, 4096, 32768)) if not smoke else ((1, 2), (64, 128))
    pool = make_fp8_pool(shape, max(batches) * max(ctxs) // PAGE + 8, device)
    if companion is not None:
        companion.prepare(pool, shape)
    gen = torch.Generator().manual_seed(1)
    sec = Section("FP8 paged decode attention, Llama-3.1-8B shapes (32 q heads, 8 KV heads, head_dim 128, page 64)",
                  ["batch", "context", "triton (us)", "triton GB/s", "% of copy BW", "torch ref (us)",
                   "ref GB/s", "SDPA bf16 (us)", "SDPA GB/s", "SDPA % of copy BW"])
    for bsz, ctx in itertools.product(batches, ctxs):
        batch = decode_batch(bsz, ctx, pool.num_pages, device, gen)
        q = torch.randn(bsz, shape.num_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
        fp8_bytes = decode_bytes(bsz, ctx, shape, 1)
        t_tri = bench_ms(_triton_decode_fn(q, pool, batch, shape, cfg, num_sms), device)
        gb_tri = fp8_bytes / (t_tri * 1e-3) / 1e9
        if companion is not None:
            companion.add(bsz, ctx, batch, q, t_tri)
        t_ref = _time_reference(q, pool, batch, shape, device)
        t_sdpa = _time_sdpa(q, pool, batch, shape, device)
        bf16_bytes = decode_bytes(bsz, ctx, shape, 2)
        gb_sdpa = bf16_bytes / (t_sdpa * 1e-3) / 1e9 if t_sdpa else None
        sec.rows.append(Row([
            bsz, ctx, t_tri * 1e3, gb_tri, pct(gb_tri, ceil.copy_gbps),
            t_ref * 1e3 if t_ref else "OOM", fp8_bytes / (t_ref * 1e-3) / 1e9 if t_ref else "-",
            t_sdpa * 1e3 if t_sdpa else "OOM", gb_sdpa or "-", pct(gb_sdpa, ceil.copy_gbps) if gb_sdpa else "-"]))
    sec.notes += [
        "GB/s counts each K/V byte once (FP8: 1 byte; SDPA: the same K/V in bf16, 2 bytes) plus q, out, block tables.",
        "torch ref: `TorchAttentionBackend` on the same FP8 pool (gathers and dequantises pages); its GB/s uses the "
        "FP8 byte count, like the Triton column.",
        "SDPA: `F.scaled_dot_product_attention(q, k, v, enable_gqa=True)` with K/V contiguous [B, 8, ctx, 128] bf16.",
        f"Triton kernel settings: block_n={cfg.block_n}, num_warps={cfg.num_warps}, num_stages={cfg.num_stages}, "
        f"programs_per_sm={cfg.programs_per_sm}, {num_sms} SMs; the per-step split-count computation is not timed.",
    ]
    return sec


def _time_reference(q, pool, batch, shape: Shape, device) -> float | None:
    ref = TorchAttentionBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim ** -0.5)
    kv = torch.zeros(q.shape[0], shape.num_kv_heads, shape.head_dim, device=device, dtype=q.dtype)
    try:
        return bench_ms(lambda: ref.forward(0, q, kv, kv, pool, batch), device, rep_ms=300)
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache() if device.type == "cuda" else None


def _time_sdpa(q, pool, batch, shape: Shape, device) -> float | None:
    try:
        k, v = pool.gather(0, batch.block_tables)  # [B, Hkv, L, D] bf16, contiguous copies
        ctx = batch.seq_lens_cpu[0]
        k, v = k[:, :, :ctx].contiguous(), v[:, :, :ctx].contiguous()
        q4 = q.unsqueeze(2)  # [B, H, 1, D]
        fn = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
        return bench_ms(fn, device, rep_ms=300)
    except torch.OutOfMemoryError:
        return None
    finally:
        k = v = None
        torch.cuda.empty_cache() if device.type == "cuda" else None


def prefill_kernel_table(device, ceil: Ceilings, smoke: bool) -> tuple[ExtendKernelConfig, Section]:
    """The extend kernel alone on one 8k-token chunk (one layer, FP8 pages), over a few launch settings."""
    shape = Shape() if not smoke else Shape(4, 2, 32)
    t = 8192 if not smoke else 64
    pool = make_fp8_pool(shape, t // PAGE + 2, device)
    table = (torch.arange(t // PAGE, dtype=torch.int32, device=device) + 1)[None]
    seq = torch.tensor([t], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=device)
    q = torch.randn(t, shape.num_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    k_cache, v_cache = pool.layer_cache(0)
    flops = 2 * shape.num_heads * shape.head_dim * t * (t + 1)  # QK^T and PV, causal
    # configurations that spill on sm_90 (128x64 and 128x32 with 4 warps) are left out (gpu_compile.py)
    grid = [(16, 16, 4, 1)] if smoke else [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                                           (64, 64, 4, 3), (64, 32, 4, 3)]
    sec = Section(f"Prefill (extend) kernel, one {t}-token chunk, one layer, FP8 pages",
                  ["block_m", "block_n", "num_warps", "num_stages", "time (ms)", "TFLOP/s", "% of bf16 matmul"])
    best = None
    for bm, bn, nw, ns in grid:
        cfg = ExtendKernelConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        fn = lambda: extend_attention(q, k_cache, v_cache, table, seq, qsl, out, 0, 1, t,  # noqa: E731
                                      shape.head_dim ** -0.5, K_SCALE, V_SCALE, cfg)
        try:
            ms = bench_ms(fn, device, rep_ms=300)
        except Exception as e:
            sec.rows.append(Row([bm, bn, nw, ns, "failed", repr(e)[:120], ""]))
            print(f"extend config {cfg} failed: {e!r}", file=sys.stderr)
            continue
        tf = flops / (ms * 1e-3) / 1e12
        sec.rows.append(Row([bm, bn, nw, ns, ms, tf, pct(tf, ceil.matmul_tflops)]))
        if best is None or ms < best[0]:
            best = (ms, cfg)
    sec.notes.append(f"FLOPs = 2 * heads * head_dim * T * (T + 1) (causal QK^T and PV); kept: {best[1]}")
    return best[1], sec
