"""MLA decode microbenchmark: the paged absorbed-MLA Triton kernel at DeepSeek-V3's shapes, over FP8 latent pages.

One layer of an FP8 E4M3 latent pool (``kv_lora_rank`` 512 + ``qk_rope_head_dim``
64 = 576 values a token, page size 64, pages scattered at random), bf16
absorbed queries for 16 heads (DeepSeek-V3 at TP 8) and 128 heads (TP 1).
Bytes counted: each latent byte read once, plus queries, outputs and block
tables; the rate is reported against the device's measured copy bandwidth.
Before timing, each batch is checked against the torch MLA reference in float64
on the same pool bytes (relative error per request, bf16 bound 1e-2).

`mla_decode_section(device, copy_gbps, smoke)` returns the table (a `gpu_common.Section`) for the GPU benchmark;
``python -m pd_cluster.bench.scripts.mla_decode [--smoke]`` prints it alone (``--smoke``: tiny sizes, on CPU
through Triton's interpreter, to check the script; it measures nothing).
"""

from __future__ import annotations

import argparse
import sys

import torch

from pd_cluster.bench.scripts.gpu_attention import batch_from_tables
from pd_cluster.bench.scripts.gpu_common import Row, Section, bench_ms, measure_ceilings, pct
from pd_cluster.engine.attention.mla import TorchMLABackend
from pd_cluster.engine.attention.mla_triton import MLA_DECODE_DEFAULTS
from pd_cluster.engine.attention.triton.decode import DecodeWorkspace, max_splits_for, num_kv_splits
from pd_cluster.engine.attention.triton.mla_decode import mla_decode_attention, mla_head_blocks
from pd_cluster.engine.kv.pool import KVLayout, KVPool

RANK, ROPE, PAGE = 512, 64, 64
LATENT_SCALE = 0.05
BF16_BOUND = 1e-2


def make_latent_pool(num_pages: int, device: torch.device) -> KVPool:
    """One layer of FP8 latent pages holding random codes (no NaN codes)."""
    layout = KVLayout(1, 1, RANK + ROPE, PAGE, "fp8_e4m3", (LATENT_SCALE,), (1.0,), kv_format="mla")
    pool = KVPool(layout, num_pages, device, torch.bfloat16)
    for lo in range(0, num_pages + 1, 4096):
        chunk = pool.kv[lo:lo + 4096]
        chunk.copy_(torch.randn(chunk.shape, device=device).to(torch.float8_e4m3fn).view(torch.uint8))
    return pool


def _check(q, pool, batch, out, heads: int, scale: float) -> float:
    ref_pool = KVPool(pool.layout, pool.num_pages, pool.device, torch.float64)
    ref_pool.kv.copy_(pool.kv)
    ref = TorchMLABackend(heads, RANK, 128, ROPE, 128, scale).decode(0, q.double(), ref_pool, batch)
    err = ((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max()
    return float(err)


def mla_decode_section(device: torch.device, copy_gbps: float, smoke: bool = False) -> Section:
    """Times of the MLA decode kernel per (heads, batch, context), with GB/s and % of `copy_gbps`."""
    heads_list = [16] if smoke else [16, 128]
    batches = [2] if smoke else [1, 8, 32, 64]
    contexts = [130] if smoke else [2048, 8192]
    num_sms = 8 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
    cfg = MLA_DECODE_DEFAULTS
    need = max(batches) * -(-max(contexts) // PAGE)
    pool = make_latent_pool(need + 1, device)
    gen = torch.Generator().manual_seed(0)
    scale = (128 + ROPE) ** -0.5
    sec = Section(f"MLA decode (absorbed), DeepSeek-V3 latent {RANK}+{ROPE}, FP8 pages of {PAGE}, bf16 queries",
                  ["heads", "batch", "context", "max rel err", "us", "GB/s", "% of copy"])
    for heads, bsz, ctx in ((h, b, c) for h in heads_list for b in batches for c in contexts):
        per = -(-ctx // PAGE)
        tables = (torch.randperm(need, generator=gen)[:bsz * per] + 1).view(bsz, per).to(torch.int32)
        batch = batch_from_tables(tables, [ctx] * bsz, device)
        q = torch.randn(bsz, heads, RANK + ROPE, generator=gen).to(device, torch.bfloat16)
        s = max_splits_for(bsz, mla_head_blocks(heads), num_sms, cfg)
        ws = DecodeWorkspace(num_kv_splits(batch.seq_lens, s, cfg), torch.empty(bsz, heads, s, RANK, device=device),
                             torch.empty(bsz, heads, s, device=device), s)
        out = torch.empty(bsz, heads, RANK, dtype=torch.bfloat16, device=device)

        def run():
            mla_decode_attention(q, pool.latent_cache(0), batch.block_tables, batch.seq_lens, out, ws, RANK, scale,
                                 LATENT_SCALE, cfg)

        run()
        err = _check(q, pool, batch, out, heads, scale)
        ms = bench_ms(run, device)
        nbytes = bsz * ctx * (RANK + ROPE) + q.numel() * 2 + out.numel() * 2 + tables.numel() * 4
        gbps = nbytes / (ms * 1e-3) / 1e9
        sec.rows.append(Row([heads, bsz, ctx, err, ms * 1e3, gbps, pct(gbps, copy_gbps)],
                            note="" if err <= BF16_BOUND else "ABOVE THE BF16 BOUND"))
    sec.notes.append(f"block_n {cfg.block_n}, num_warps {cfg.num_warps}, num_stages {cfg.num_stages}; "
                     f"{num_sms} SMs; errors against the float64 torch reference (bound {BF16_BOUND})")
    return sec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mla_decode", allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton's interpreter); measures nothing")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("mla_decode: needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    copy = measure_ceilings(device, args.smoke).copy_gbps
    print(mla_decode_section(device, copy, args.smoke).markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
