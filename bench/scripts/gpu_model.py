"""Whole-model parts of the GPU benchmark: a Llama-3.1-8B decode step (with and without CUDA graphs) and an 8k prefill.

The model is built from Llama-3.1-8B's public config with ``--load-format
dummy`` (seeded random bf16 weights), so no checkpoint is needed on the device.
The KV pool is FP8 E4M3, page 64, filled with random codes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, llama_config, pct
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend, TritonAttentionConfig
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.graph import CudaGraphConfig, CudaGraphRunner
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.layer_ops import TritonLayerOps
from pd_cluster.engine.model.loader import LoadedModel, load_model

PAGE = 64


def load_dummy(device: torch.device, smoke: bool) -> LoadedModel:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(llama_config(smoke)))
        # bf16 as served; the smoke toy uses fp32 (the interpreter has no bf16 tl.dot)
        loaded = load_model(d, "float32" if smoke else "bfloat16", load_format="dummy", seed=0, device=device)
    loaded.model.set_layer_ops(TritonLayerOps())  # as a worker with the triton backend runs it
    return loaded


def cuda_kernels_per_call(fn, device: torch.device) -> int | None:
    """GPU kernels (and device copies) one call of `fn` launches, from the profiler; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def top_kernels(fn, device: torch.device, n: int = 8) -> list[str]:
    """The `n` GPU kernels (and device copies) with the most device time in one call of `fn`, from torch.profiler:
    ``name: microseconds (launches)`` each, largest first, then the total; empty off CUDA."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = totals.setdefault(e.name, [0.0, 0])
            t[0] += e.time_range.elapsed_us()
            t[1] += 1
    whole = sum(t for t, _ in totals.values())
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{name[:90]}: {us:.0f} us ({count})" for name, (us, count) in top] + [f"all kernels: {whole:.0f} us"]


def fp8_pool(loaded: LoadedModel, num_pages: int, device: torch.device) -> KVPool:
    a = loaded.arch
    scales = (0.05,) * a.num_hidden_layers
    layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, PAGE, "fp8_e4m3", scales, scales)
    pool = KVPool(layout, num_pages, device, loaded.dtype)
    for lo in range(0, num_pages + 1, 256):
        chunk = pool.kv[lo:lo + 256]
        chunk.copy_((torch.randn(chunk.shape, device=device) * 4).to(torch.float8_e4m3fn).view(torch.uint8))
    return pool


def backend_for(loaded: LoadedModel, cfg: TritonAttentionConfig) -> TritonAttentionBackend:
    a = loaded.arch
    return TritonAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5,
                                  config=cfg)


def _decode_batch(bsz: int, ctx: int, device: torch.device):
    per = -(-ctx // PAGE)
    perm = np.random.default_rng(0).permutation(bsz * per) + 1
    tables = [perm[i * per:(i + 1) * per].tolist() for i in range(bsz)]
    ids = [np.array([7 + i], dtype=np.int64) for i in range(bsz)]
    rows = [np.array([0])] * bsz
    return build_forward_batch(ids, [ctx - 1] * bsz, tables, rows, bsz, PAGE, device)


def weight_bytes_read(loaded: LoadedModel, num_tokens: int) -> int:
    """Bytes of weights a step reads: every matrix once, only `num_tokens` rows of the input embedding."""
    emb = loaded.model.embed_tokens.weight
    total = loaded.weights_nbytes
    if loaded.arch.tie_word_embeddings:
        return total
    return total - emb.numel() * emb.element_size() + num_tokens * emb.shape[1] * emb.element_size()


def decode_step_table(loaded: LoadedModel, device, ceil: Ceilings, cfg: TritonAttentionConfig, smoke: bool) -> Section:
    a = loaded.arch
    bsz, ctx = (64, 2048) if not smoke else (2, 128)
    pool = fp8_pool(loaded, bsz * (-(-ctx // PAGE)) + 4, device)
    backend = backend_for(loaded, cfg)
    batch = _decode_batch(bsz, ctx, device)
    kv_bytes = bsz * ctx * a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim  # FP8: 1 byte
    w_bytes = weight_bytes_read(loaded, bsz)
    floor_ms = (w_bytes + kv_bytes) / (ceil.copy_gbps * 1e9) * 1e3
    t_eager = bench_ms(lambda: loaded.model(batch, pool, backend), device, rep_ms=1000)
    kernels = cuda_kernels_per_call(lambda: loaded.model(batch, pool, backend), device)
    per_layer = "-" if kernels is None else f"{kernels} ({kernels / a.num_hidden_layers:.1f}/layer)"
    rows = [Row(["eager (no graph)", t_eager, floor_ms, t_eager / floor_ms, bsz / (t_eager * 1e-3), per_layer])]
    if device.type == "cuda":
        runner = CudaGraphRunner(loaded.model, pool, backend, CudaGraphConfig(max_bs=bsz, max_context_len=ctx + PAGE))
        runner.capture()
        t_graph = bench_ms(lambda: runner.replay(batch), device, rep_ms=1000)
        rows.append(Row(["CUDA graph", t_graph, floor_ms, t_graph / floor_ms, bsz / (t_graph * 1e-3), per_layer]))
    sec = Section(f"Decode step, Llama-3.1-8B (dummy bf16 weights), FP8 KV, batch {bsz}, context {ctx}",
                  ["mode", "time (ms)", "floor (ms)", "x floor", "tokens/s", "GPU kernels/step"], rows)
    sec.notes += [
        f"floor = (weight bytes read {w_bytes / 1e9:.2f} GB + KV bytes {kv_bytes / 1e9:.2f} GB) / measured copy "
        f"bandwidth {ceil.copy_gbps:.0f} GB/s; the input embedding counts only the {bsz} rows gathered.",
        "Graph time includes copying the batch into the static buffers (device-to-device) and the replay.",
        "Kernels: every GPU kernel and device copy of one eager step, from torch.profiler (fused layer ops on; "
        "tests/kernels/test_launch_count.py asserts <= 12 per layer on CPU).",
    ]
    top = top_kernels(lambda: loaded.model(batch, pool, backend), device)
    if top:
        sec.notes.append("top GPU kernels of one eager step (torch.profiler, device time): " + "; ".join(top))
    del pool
    return sec


def prefill_flops(loaded: LoadedModel, t: int) -> float:
    a = loaded.arch
    h, i = a.hidden_size, a.intermediate_size
    per_layer = 2 * t * (h * (a.q_size + 2 * a.kv_size) + a.q_size * h + 3 * h * i)
    attn = 2 * a.num_attention_heads * a.head_dim * t * (t + 1)  # causal QK^T + PV
    return a.num_hidden_layers * (per_layer + attn) + 2 * h * a.vocab_size  # one logits row


def prefill_table(loaded: LoadedModel, device, ceil: Ceilings, cfg: TritonAttentionConfig, smoke: bool) -> Section:
    t = 8192 if not smoke else 128
    pool = fp8_pool(loaded, t // PAGE + 2, device)
    backend = backend_for(loaded, cfg)
    ids = [np.random.default_rng(1).integers(0, loaded.arch.vocab_size, size=t).astype(np.int64)]
    batch = build_forward_batch(ids, [0], [list(range(1, t // PAGE + 1))], [np.array([t - 1])], 0, PAGE, device)
    ms = bench_ms(lambda: loaded.model(batch, pool, backend), device, rep_ms=3000, warmup_ms=500)
    flops = prefill_flops(loaded, t)
    tf = flops / (ms * 1e-3) / 1e12
    sec = Section(f"Prefill of one {t}-token chunk, Llama-3.1-8B (dummy bf16 weights), FP8 KV",
                  ["time (ms)", "TFLOP/s", "% of bf16 matmul", "tokens/s"],
                  [Row([ms, tf, pct(tf, ceil.matmul_tflops), t / (ms * 1e-3)])])
    sec.notes.append(f"FLOPs {flops / 1e12:.1f} T: projections and MLP 2*T*params per layer, causal attention "
                     "2*heads*head_dim*T*(T+1) per layer, one logits row; whole forward incl. norms and RoPE.")
    top = top_kernels(lambda: loaded.model(batch, pool, backend), device)
    if top:
        sec.notes.append("top GPU kernels of one prefill (torch.profiler, device time): " + "; ".join(top))
    return sec


def _verify_batch(tables: list[list[int]], ctx: int, k: int, device: torch.device):
    """Requests at context `ctx` on `tables`, each verifying `k` drafts: one extend of k + 1 tokens (the last
    accepted token and the drafts), every row's logits wanted, as `engine/spec/verify.py` runs it; k = 0 is the
    plain decode step."""
    bsz = len(tables)
    ids = [np.array([7 + i] + [11 + i + j for j in range(k)], dtype=np.int64) for i in range(bsz)]
    rows = [np.arange(k + 1)] * bsz
    return build_forward_batch(ids, [ctx - 1] * bsz, tables, rows, bsz if k == 0 else 0, PAGE, device)


def verify_step_table(loaded: LoadedModel, device, cfg: TritonAttentionConfig, smoke: bool) -> Section:
    """Speculative decoding's verify step against a plain decode step at the same batch and context.

    A step that verifies K drafts per request is one extend of K + 1 tokens with every row's logits; it pays off
    when the mean accepted length exceeds ``time(K) / time(decode) - 1`` (each step then yields accepted + 1 tokens
    per request instead of one). Each row's first logits row is checked against the decode step's (same token,
    same pages) in the table, before it is timed.
    """
    bsz, ctx = (64, 2048) if not smoke else (2, 128)
    kmax = 8
    per = -(-(ctx + kmax) // PAGE)
    pool = fp8_pool(loaded, bsz * per + 4, device)
    perm = np.random.default_rng(0).permutation(bsz * per) + 1
    tables = [perm[i * per:(i + 1) * per].tolist() for i in range(bsz)]
    backend = backend_for(loaded, cfg)
    decode = _verify_batch(tables, ctx, 0, device)
    want = loaded.model(decode, pool, backend).float()
    t0 = bench_ms(lambda: loaded.model(decode, pool, backend), device, rep_ms=1000)
    rows = [Row([0, 1, t0, 1.0, 0.0, 0.0])]
    for k in (2, 4, 8):
        batch = _verify_batch(tables, ctx, k, device)
        got = loaded.model(batch, pool, backend).float().view(bsz, k + 1, -1)[:, 0]
        err = (got - want).abs().max().item()
        t = bench_ms(lambda: loaded.model(batch, pool, backend), device, rep_ms=1000)
        rows.append(Row([k, k + 1, t, t / t0, t / t0 - 1, err]))
    sec = Section(f"Speculative verify step, Llama-3.1-8B (dummy bf16 weights), FP8 KV, batch {bsz}, context {ctx}",
                  ["drafts K", "tokens per request", "time (ms)", "x decode step", "break-even accepted length",
                   "max |logit - decode's|"], rows)
    sec.notes += [
        "K = 0 is the plain decode step (eager, no CUDA graph; the verify extend runs eager in the engine too).",
        "Break-even: speculation with mean accepted length a yields (a + 1) tokens per step at time(K), against one "
        "token at time(0); it is faster when a > time(K) / time(0) - 1. NGRAM's accepted lengths on CPU are in "
        "docs/perf/spec-decode.md.",
        "max |logit - decode's|: the verify extend's first row against the decode step's logits for the same token "
        "and pages (extend and decode kernels differ in reduction order).",
    ]
    del pool
    return sec
