"""The decode step of the GPU first contact (`first_contact`): ceilings, FP8 decode attention, decode throughput
at batch 1/64/256, and the 8k prefill, each against its raised target (`first_contact_part.TARGETS`).

In order, each item recorded as soon as it is measured:

1. the device's ceilings (`gpu_common.measure_ceilings`: a device-to-device copy and a bf16 8192^3 product), kept
   in the work folder for the later steps;
2. FP8 paged decode attention at Llama-3.1-8B's shapes, batch 32/64/128 x context 4k/32k, engine defaults
   (`gpu_attention`): % of copy bandwidth; target: the worst cell >= 85%;
3. the Llama-3.1-8B decode step (dummy bf16 weights, FP8 KV, page 64, context 2k) replayed from CUDA graphs at
   batch 1, 64 and 256 (one pool, one runner capturing every bucket up to 256), and eager at batch 64: step time,
   output tokens/s (batch / step time) and the memory floor ((weights read + KV read) / copy rate); target:
   batch 64 <= 1.15x its floor;
4. speculative decoding: a hook that skips with its reason until the engine has ``--speculative-algorithm``;
5. the prefill of one 8192-token chunk (`gpu_model.prefill_table`): % of the bf16 matmul rate; target >= 80%.

A missed target is recorded with the top kernels of the missed call from ``torch.profiler``. ``--dry-run``: the
benchmark's smoke shapes on CPU (Triton's interpreter): it checks the code paths, its numbers mean nothing.
"""

from __future__ import annotations

import gc
import sys

import torch

from pd_cluster.bench.scripts.first_contact_part import Part, finish, load_ceilings, profile_top, start_part
from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, pct

CONTEXT = 2048
BATCHES = (1, 64, 256)
TARGET_BATCH = 64


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ceilings(part: Part, device: torch.device, work, smoke: bool) -> Ceilings:
    ceil = load_ceilings(work, device, smoke)
    sec = Section("Ceilings measured on this device", ["copy GB/s (read + write)", "bf16 matmul TFLOP/s"],
                  [Row([ceil.copy_gbps, ceil.matmul_tflops])])
    sec.notes.append(f"copy: {ceil.copy_bytes / 2**30:.2f} GiB buffer; matmul: {ceil.matmul_n}^3, random bf16.")
    part.section(sec)
    part.info("ceilings", ceil.__dict__)
    return ceil


def attention(part: Part, device: torch.device, ceil: Ceilings, smoke: bool) -> None:
    """FP8 paged decode attention at the target's cells, engine defaults; the worst cell against 85%."""
    from pd_cluster.bench.scripts import gpu_attention as ga

    shape = ga.Shape() if not smoke else ga.Shape(4, 2, 32)
    cells = [(b, c) for b in (32, 64, 128) for c in (4096, 32768)] if not smoke else [(2, 128)]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    cfg = ga.DecodeKernelConfig()
    pool = ga.make_fp8_pool(shape, max(b * -(-c // ga.PAGE) for b, c in cells) + 8, device)
    gen = torch.Generator().manual_seed(0)
    sec = Section("FP8 paged decode attention, Llama-3.1-8B shapes (32 q / 8 KV heads, head_dim 128), page 64, "
                  "engine defaults", ["batch", "context", "time (us)", "GB/s", "% of copy BW"])
    worst = None
    for bsz, ctx in cells:
        batch = ga.decode_batch(bsz, ctx, pool.num_pages, device, gen)
        q = torch.randn(bsz, shape.num_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
        fn = ga._triton_decode_fn(q, pool, batch, shape, cfg, num_sms)
        ms = bench_ms(fn, device)
        gbps = ga.decode_bytes(bsz, ctx, shape, 1) / (ms * 1e-3) / 1e9
        sec.rows.append(Row([bsz, ctx, ms * 1e3, gbps, pct(gbps, ceil.copy_gbps)]))
        if worst is None or pct(gbps, ceil.copy_gbps) < worst[0]:
            worst = (pct(gbps, ceil.copy_gbps), bsz, ctx, fn)
    sec.notes.append(f"block_n {cfg.block_n}, {cfg.num_warps} warps, {cfg.num_stages} stages, at least "
                     f"{cfg.min_splits} splits; bytes: each K/V byte once plus queries, outputs and block tables.")
    part.section(sec)
    value, bsz, ctx, fn = worst
    part.target("attention", value, f"batch {bsz}, context {ctx}",
                top=profile_top(fn, device) if part.misses("attention", value) else None)
    del pool
    _free(device)


def decode_steps(part: Part, loaded, device: torch.device, ceil: Ceilings, smoke: bool) -> None:
    """Graph replays at every batch of `BATCHES` from one pool and runner; eager at the target batch."""
    from pd_cluster.bench.scripts import gpu_model as gm
    from pd_cluster.engine.attention.triton_backend import TritonAttentionConfig
    from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner

    a = loaded.arch
    ctx = CONTEXT if not smoke else 128
    batches = BATCHES if not smoke else (1, 2)
    target_bs = TARGET_BATCH if not smoke else 2
    per = -(-ctx // gm.PAGE)
    pool = gm.fp8_pool(loaded, max(batches) * per + 4, device)
    backend = gm.backend_for(loaded, TritonAttentionConfig())
    runner = CudaGraphRunner(loaded.model, pool, backend,
                             CudaGraphConfig(max_bs=max(batches), max_context_len=ctx + gm.PAGE,
                                             eager_stand_in=device.type != "cuda"))
    if device.type == "cuda":
        runner.capture()
    sec = Section(f"Decode step, Llama-3.1-8B (dummy bf16 weights), FP8 KV, context {ctx}",
                  ["batch", "mode", "step (ms)", "floor (ms)", "x floor", "output tokens/s"])
    at_target = None
    for bsz in batches:
        batch = gm._decode_batch(bsz, ctx, device)
        kv_bytes = bsz * ctx * a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim  # FP8: 1 byte each
        floor_ms = (gm.weight_bytes_read(loaded, bsz) + kv_bytes) / (ceil.copy_gbps * 1e9) * 1e3
        modes = [("CUDA graph" if runner.captured else "graph runner (eager stand-in)",
                  lambda b=batch: runner.replay(b))]
        if bsz == target_bs:
            modes.append(("eager", lambda b=batch: loaded.model(b, pool, backend)))
        for mode, fn in modes:
            with torch.inference_mode():
                ms = bench_ms(fn, device, rep_ms=500)
            sec.rows.append(Row([bsz, mode, ms, floor_ms, ms / floor_ms, bsz / (ms * 1e-3)]))
            if bsz == target_bs and mode != "eager":
                at_target = (ms / floor_ms, fn)
    sec.notes.append(f"floor = (weight bytes read + FP8 KV bytes) / measured copy rate {ceil.copy_gbps:.0f} GB/s; "
                     "the graph time includes copying the batch into the static buffers; tokens/s = batch / step.")
    part.section(sec)
    x, fn = at_target
    top = None
    if part.misses("decode_step", x):
        with torch.inference_mode():
            top = profile_top(fn, device)
            if len(top) <= 1:  # no kernel seen inside the graph replay: profile the same step eagerly
                batch = gm._decode_batch(target_bs, ctx, device)
                top = ["(eager step)"] + profile_top(lambda: loaded.model(batch, pool, backend), device)
    part.target("decode_step", x, f"batch {target_bs}, context {ctx}, graphs", top=top)
    del runner, pool
    _free(device)


def speculative_hook(part: Part) -> None:
    """Decode with speculative decoding, once the engine has it; until then a skip with the reason."""
    from pd_cluster.engine.args import ENGINE_FLAGS

    names = {name for f in ENGINE_FLAGS for name in (f.name, *f.aliases)}
    if "--speculative-algorithm" not in names:
        part.skip("decode throughput with speculative decoding",
                  "not built: the engine has no --speculative-algorithm flag (engine/args.py)")
        return
    part.skip("decode throughput with speculative decoding",
              "the engine has --speculative-algorithm, but this script does not measure it yet: add it here")


def prefill(part: Part, loaded, device: torch.device, ceil: Ceilings, smoke: bool) -> None:
    """One prefill chunk of 8192 random tokens (whole forward, one logits row) against the bf16 matmul rate."""
    import numpy as np

    from pd_cluster.bench.scripts import gpu_model as gm
    from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig
    from pd_cluster.engine.attention.triton_backend import TritonAttentionConfig
    from pd_cluster.engine.batch import build_forward_batch

    t = 8192 if not smoke else 32
    cfg = TritonAttentionConfig() if not smoke else TritonAttentionConfig(extend=ExtendKernelConfig(16, 16))
    pool = gm.fp8_pool(loaded, t // gm.PAGE + 2, device)
    backend = gm.backend_for(loaded, cfg)
    ids = [np.random.default_rng(1).integers(0, loaded.arch.vocab_size, size=t).astype(np.int64)]
    pages = list(range(1, -(-t // gm.PAGE) + 1))
    batch = build_forward_batch(ids, [0], [pages], [np.array([t - 1])], 0, gm.PAGE, device)

    def run():
        with torch.inference_mode():
            loaded.model(batch, pool, backend)

    ms = bench_ms(run, device, rep_ms=2000, warmup_ms=300)
    tf = gm.prefill_flops(loaded, t) / (ms * 1e-3) / 1e12
    share = pct(tf, ceil.matmul_tflops)
    sec = Section(f"Prefill of one {t}-token chunk, Llama-3.1-8B (dummy bf16 weights), FP8 KV",
                  ["time (ms)", "TFLOP/s", "% of bf16 matmul", "tokens/s"], [Row([ms, tf, share, t / (ms * 1e-3)])])
    sec.notes.append("FLOPs: projections and MLP 2*T*params per layer, causal attention 2*heads*head_dim*T*(T+1) per "
                     "layer, one logits row (gpu_model.prefill_flops); whole forward incl. norms and RoPE.")
    part.section(sec)
    part.target("prefill", share, f"{t}-token chunk",
                top=profile_top(run, device) if part.misses("prefill", share) else None)
    del pool


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "decode", __doc__)
    device, smoke = args.device, args.dry_run
    torch.manual_seed(0)
    ceil = None
    with part.guard("ceilings"):
        ceil = ceilings(part, device, args.work, smoke)
    if ceil is None:
        return finish(part)
    with part.guard("FP8 decode attention"):
        attention(part, device, ceil, smoke)
    loaded = None
    with part.guard("load Llama-3.1-8B (dummy weights)"):
        from pd_cluster.bench.scripts.gpu_model import load_dummy
        loaded = load_dummy(device, smoke)
    if loaded is not None:
        with part.guard("decode steps at batch 1/64/256"):
            decode_steps(part, loaded, device, ceil, smoke)
        speculative_hook(part)
        with part.guard("8k prefill"):
            prefill(part, loaded, device, ceil, smoke)
    return finish(part)


if __name__ == "__main__":
    sys.exit(main())
