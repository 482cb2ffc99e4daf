"""The MoE and MLA step of the GPU first contact (`first_contact`): both decode-time kernels at batch 64 against
their memory floors, and the DP/EP hooks.

- **Fused MoE** (`engine/attention/triton/fused_moe.py`, `fused_experts`) at Mixtral-8x7B's expert shapes (TP 1)
  and DeepSeek-V3's (one rank of TP 8), 64 tokens (a decode batch of 64) with random top-k routing, bf16. The
  kernel is first compared with the float32 torch path on 7 tokens (`moe_bench._check`); one that does not match
  is not timed. Memory floor: every expert the batch routes to read once (3 H I bf16 values each), plus the
  tokens in and out, over the measured copy rate. Target: >= 70% of the floor (floor time / kernel time).
- **MLA decode** (`engine/attention/triton/mla_decode.py`, absorbed form) at DeepSeek-V3's latent (512 + 64),
  FP8 pages of 64, bf16 queries, batch 64, 16 heads (TP 8) and 128 heads (TP 1), context 2k and 8k; each cell
  checked against the float64 torch reference first (`mla_decode._check`). Floor: every latent byte read once,
  plus queries, outputs and block tables. Target: the worst cell >= 70%.
- **DP and EP**: hooks that skip with their reason (no ``--dp-size``; expert parallelism needs two devices).

A miss is recorded with the kernel's top kernels from ``torch.profiler``. ``--dry-run``: tiny shapes on CPU
(Triton's interpreter); it checks the code paths, its numbers mean nothing.
"""

from __future__ import annotations

import sys

import torch

from pd_cluster.bench.scripts.first_contact_part import Part, finish, load_ceilings, profile_top, start_part
from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, pct

BATCH = 64


def moe(part: Part, device: torch.device, ceil: Ceilings, smoke: bool) -> None:
    from pd_cluster.bench.scripts import moe_bench as mb
    from pd_cluster.engine.attention.triton.fused_moe import fused_experts

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter has no bf16 dot
    shapes = [mb.GPU_SHAPES[0], mb.GPU_SHAPES[2]] if not smoke else mb.SMOKE_SHAPES
    tokens = BATCH if not smoke else 8
    sec = Section(f"Fused MoE kernel, {tokens} tokens (decode batch), routed experts, against its memory floor",
                  ["experts (H, I per rank, E, top-k)", "max rel err", "experts used", "time (us)", "floor (us)",
                   "% of floor"])
    gen = torch.Generator().manual_seed(0)
    for s in shapes:
        label = f"{s.name}: {s.hidden}, {s.inter}, {s.experts}, {s.top_k}"
        with part.guard(f"fused MoE {s.name}"):
            err = mb._check(s, device, dtype, fused_experts)
            if not err <= 2e-2:
                sec.rows.append(Row([label, err, "-", "NOT TIMED: does not match the torch path", "", ""]))
                continue
            w13 = (torch.randn(s.experts, 2 * s.inter, s.hidden, generator=gen) * s.hidden ** -0.5).to(device, dtype)
            w2 = (torch.randn(s.experts, s.hidden, s.inter, generator=gen) * s.inter ** -0.5).to(device, dtype)
            x = torch.randn(tokens, s.hidden, generator=gen).to(device, dtype)
            weights, ids = mb._routing(tokens, s, device, gen)

            def run():
                fused_experts(x, w13, w2, weights, ids)

            ms = bench_ms(run, device)
            used = len(set(ids.flatten().tolist()))
            nbytes = used * 3 * s.hidden * s.inter * w13.element_size() + 2 * x.numel() * x.element_size()
            floor_ms = nbytes / (ceil.copy_gbps * 1e9) * 1e3
            share = 100.0 * floor_ms / ms
            sec.rows.append(Row([label, err, f"{used} of {s.experts}", ms * 1e3, floor_ms * 1e3, share]))
            part.target("moe", share, s.name, top=profile_top(run, device) if part.misses("moe", share) else None)
            del w13, w2
    sec.notes.append("random routing (softmax of Gaussian logits, top-k, renormalised); floor = (used experts' "
                     f"3 H I weights + tokens in and out) / copy rate {ceil.copy_gbps:.0f} GB/s; errors: 7 tokens "
                     "against the float32 torch path.")
    part.section(sec)


def mla(part: Part, device: torch.device, ceil: Ceilings, smoke: bool) -> None:
    from pd_cluster.bench.scripts import mla_decode as md
    from pd_cluster.bench.scripts.gpu_attention import batch_from_tables
    from pd_cluster.engine.attention.mla_triton import MLA_DECODE_DEFAULTS
    from pd_cluster.engine.attention.triton.decode import DecodeWorkspace, max_splits_for, num_kv_splits
    from pd_cluster.engine.attention.triton.mla_decode import mla_decode_attention, mla_head_blocks

    cells = [(h, c) for h in (16, 128) for c in (2048, 8192)] if not smoke else [(16, 130)]
    bsz = BATCH if not smoke else 2
    num_sms = 8 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
    cfg = MLA_DECODE_DEFAULTS
    need = bsz * -(-max(c for _, c in cells) // md.PAGE)
    pool = md.make_latent_pool(need + 1, device)
    gen = torch.Generator().manual_seed(0)
    scale = (128 + md.ROPE) ** -0.5
    sec = Section(f"MLA decode (absorbed), DeepSeek-V3 latent {md.RANK}+{md.ROPE}, FP8 pages of {md.PAGE}, batch "
                  f"{bsz}, against its memory floor", ["heads", "context", "max rel err", "time (us)", "floor (us)",
                                                       "% of floor"])
    worst = None
    for heads, ctx in cells:
        per = -(-ctx // md.PAGE)
        tables = (torch.randperm(need, generator=gen)[:bsz * per] + 1).view(bsz, per).to(torch.int32)
        batch = batch_from_tables(tables, [ctx] * bsz, device)
        q = torch.randn(bsz, heads, md.RANK + md.ROPE, generator=gen).to(device, torch.bfloat16)
        s = max_splits_for(bsz, mla_head_blocks(heads), num_sms, cfg)
        ws = DecodeWorkspace(num_kv_splits(batch.seq_lens, s, cfg),
                             torch.empty(bsz, heads, s, md.RANK, device=device),
                             torch.empty(bsz, heads, s, device=device), s)
        out = torch.empty(bsz, heads, md.RANK, dtype=torch.bfloat16, device=device)

        def run(q=q, batch=batch, out=out, ws=ws):
            mla_decode_attention(q, pool.latent_cache(0), batch.block_tables, batch.seq_lens, out, ws, md.RANK,
                                 scale, md.LATENT_SCALE, cfg)

        run()
        err = md._check(q, pool, batch, out, heads, scale)
        ms = bench_ms(run, device)
        nbytes = bsz * ctx * (md.RANK + md.ROPE) + q.numel() * 2 + out.numel() * 2 + tables.numel() * 4
        floor_ms = nbytes / (ceil.copy_gbps * 1e9) * 1e3
        share = 100.0 * floor_ms / ms
        sec.rows.append(Row([heads, ctx, err, ms * 1e3, floor_ms * 1e3, share],
                            note="" if err <= md.BF16_BOUND else "ABOVE THE BF16 BOUND"))
        if err > md.BF16_BOUND:
            part.error(f"MLA decode {heads} heads, context {ctx}",
                       ValueError(f"relative error {err:.3g} above the bf16 bound {md.BF16_BOUND}"))
        elif worst is None or share < worst[0]:
            worst = (share, heads, ctx, run)
    sec.notes.append(f"block_n {cfg.block_n}, {cfg.num_warps} warps, {cfg.num_stages} stages; {num_sms} SMs; floor "
                     f"= latent bytes once + queries, outputs, tables over the copy rate {ceil.copy_gbps:.0f} GB/s; "
                     "errors against the float64 torch reference")
    part.section(sec)
    if worst is not None:
        share, heads, ctx, run = worst
        part.target("mla", share, f"{heads} heads, context {ctx}",
                    top=profile_top(run, device) if part.misses("mla", share) else None)


def parallel_hooks(part: Part) -> None:
    """DP and EP steps: skipped with their reason until they can run here."""
    from pd_cluster.engine.args import ENGINE_FLAGS

    names = {name for f in ENGINE_FLAGS for name in (f.name, *f.aliases)}
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "--dp-size" not in names:
        part.skip("data-parallel attention (DP) decode step", "not built: the engine has no --dp-size flag")
    else:
        part.skip("data-parallel attention (DP) decode step", "built, but not measured by this script yet")
    if devices < 2:
        part.skip("expert-parallel (EP) MoE step", f"needs >= 2 devices (--enable-expert-parallel shards whole "
                  f"experts across TP ranks); this machine has {devices}")
    else:
        part.skip("expert-parallel (EP) MoE step", "not measured by this script yet (one-device run)")


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "moe_mla", __doc__)
    ceil = None
    with part.guard("ceilings"):
        ceil = load_ceilings(args.work, args.device, args.dry_run)
    if ceil is not None:
        with part.guard("fused MoE at batch 64"):
            moe(part, args.device, ceil, args.dry_run)
        with part.guard("MLA decode at batch 64"):
            mla(part, args.device, ceil, args.dry_run)
    parallel_hooks(part)
    return finish(part)


if __name__ == "__main__":
    sys.exit(main())
