"""GPU benchmark of the fast path: ceilings, FP8 decode attention, decode step, prefill, NIXL.

Run on a CUDA machine (one command; about 5 minutes on an H100)::

    python -m pd_cluster.bench.scripts.gpu --output gpu-bench.md

It measures, in one run and on the device itself:

1. the two ceilings: device-to-device copy bandwidth and the bf16 matrix rate;
2. FP8 paged decode attention at Llama-3.1-8B shapes, batch 1/32/128 x context
   1k/4k/32k, against the torch reference backend and bf16 SDPA (after a
   small sweep of the kernel's launch settings at batch 32, context 4k), and
   FlashInfer's paged decode on the same pool and batches when it is
   installed (`gpu_flashinfer`; otherwise one row says it is not);
3. a Llama-3.1-8B decode step (dummy weights, FP8 KV, batch 64, context 2k)
   with and without CUDA graphs, against (weight + KV bytes) / bandwidth,
   with the GPU kernels it launches and the top kernels by time;
4. prefill of an 8k-token chunk on Llama-3.1-8B: TFLOP/s against the matrix
   rate, with the top kernels by time;
5. NIXL VRAM-to-VRAM WRITE between two processes on the one GPU;
6. the fused MoE kernel at Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 (one TP-8
   rank) shapes (`moe_bench.fused_moe_table`) and the paged MLA decode kernel at
   DeepSeek-V3's shapes (`mla_decode.mla_decode_section`), each checked against
   the torch path before it is timed; the quantised GEMMs (FP8 blocks and per tensor, int4) against the bf16
   matmul at Llama-3.1-8B and DeepSeek-V3 (TP 8) shapes (`gpu_quant_gemm.quant_gemm_table`);
7. the 8k-token prefill kernel alone (launch-settings sweep);
8. the pool-layout question: decode attention on a 32-layer ~50 GiB pool
   against a 1-layer pool, at page sizes 16 and 64 (`gpu_layout`);
9. a sweep of the decode kernel's launch settings and split sizing at several
   (batch, context) points (`gpu_attention.decode_sweep`);
10. the fused MoE kernel on quantised experts, DeepSeek-V3's FP8 blocks (W8A8) and
    gpt-oss-120b's MXFP4, against the bf16 kernel and the weight-read floor
    (`gpu_quant_moe.quant_moe_table`);
11. speculative decoding's verify step (an extend of K + 1 tokens per request, K = 2, 4, 8) against the decode
    step at batch 64, context 2k, with the mean accepted length each needs to pay off
    (`gpu_model.verify_step_table`).

Prints a markdown table per part and writes them, with the device, date and
command, to ``--output`` (and the raw numbers to the same name with ``.json``),
rewriting both after every table, so a run stopped part-way keeps what it measured.
``--smoke`` runs tiny shapes on any device (the kernels in Triton's interpreter
on CPU) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from pd_cluster.bench.scripts.gpu_common import Row, Section, measure_ceilings

PARTS = ("decode", "decode_step", "prefill", "nixl", "moe", "quant", "mla", "prefill_kernel", "layout", "decode_sweep",
         "quant_moe", "verify")


def device_info(device: torch.device) -> str:
    import triton
    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- command: `python -m pd_cluster.bench.scripts.gpu {' '.join(sys.argv[1:])}`",
             f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}"]
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        lines.append(f"- device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, "
                     f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, capability {p.major}.{p.minor}")
    else:
        lines.append(f"- device: CPU ({platform.processor() or platform.machine()}); Triton interpreter; smoke only")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 prog="python -m pd_cluster.bench.scripts.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--output", default="gpu-bench.md", help="markdown file for the tables (default: gpu-bench.md)")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to skip: {','.join(PARTS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script only")
    ap.add_argument("--no-tune", action="store_true",
                    help="measure the decode kernel with the engine's default settings (no launch-settings sweep)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, emit=None) -> list[Section]:
    """Measure every part not skipped, most valuable first; `emit` gets each table as soon as it is measured.

    Order: ceilings, decode attention (launch settings, then the table and FlashInfer), the decode step, the
    8k prefill, NIXL, then the prefill-kernel sweep and the pool-layout study (least needed for the targets).
    The model prefill runs with the default extend-kernel settings unless the sweep ran before it.
    """
    from pd_cluster.bench.scripts import gpu_attention, gpu_flashinfer, gpu_model, gpu_nixl
    from pd_cluster.engine.attention.triton_backend import TritonAttentionConfig

    emit = emit or _emit
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke to check the script on CPU (numbers mean nothing)")
    skip = {s for s in args.skip.split(",") if s}
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    torch.manual_seed(0)
    sections: list[Section] = []

    def add(sec: Section) -> None:
        sections.append(sec)
        emit(sec)

    ceil = measure_ceilings(device, args.smoke)
    sec = Section("Ceilings measured on this device", ["copy GB/s (read + write)", "bf16 matmul TFLOP/s"])
    sec.rows.append(Row([ceil.copy_gbps, ceil.matmul_tflops]))
    sec.notes.append(f"copy: {ceil.copy_bytes / 2**30:.2f} GiB buffer; matmul: {ceil.matmul_n}^3, random bf16.")
    add(sec)

    decode_cfg = gpu_attention.DecodeKernelConfig()
    if "decode" not in skip:
        if not args.no_tune:
            decode_cfg, tune = gpu_attention.tune_decode(device, num_sms, args.smoke)
            add(tune)
        flashinfer = gpu_flashinfer.FlashInferDecode(device, ceil)
        add(gpu_attention.decode_table(device, ceil, decode_cfg, num_sms, args.smoke, flashinfer))
        add(flashinfer.section)
        del flashinfer
        _free(device)
    extend_cfg = gpu_attention.ExtendKernelConfig() if not args.smoke else gpu_attention.ExtendKernelConfig(16, 16)
    cfg = TritonAttentionConfig(decode=decode_cfg, extend=extend_cfg)
    if {"decode_step", "prefill", "verify"} - skip:
        _free(device)
        loaded = gpu_model.load_dummy(device, args.smoke)
        if "decode_step" not in skip:
            add(gpu_model.decode_step_table(loaded, device, ceil, cfg, args.smoke))
            _free(device)
        if "prefill" not in skip:
            add(gpu_model.prefill_table(loaded, device, ceil, cfg, args.smoke))
            _free(device)
        if "verify" not in skip:
            add(gpu_model.verify_step_table(loaded, device, cfg, args.smoke))
        del loaded
        _free(device)
    if "nixl" not in skip:
        add(gpu_nixl.nixl_table(ceil.copy_gbps, device.type == "cuda", args.smoke))
    if "moe" not in skip:
        from pd_cluster.bench.scripts.moe_bench import fused_moe_table

        add(fused_moe_table(device, args.smoke, ceil))
        _free(device)
    if "quant" not in skip:
        from pd_cluster.bench.scripts.gpu_quant_gemm import quant_gemm_table

        add(quant_gemm_table(device, args.smoke, ceil))
        _free(device)
    if "mla" not in skip:
        from pd_cluster.bench.scripts.mla_decode import mla_decode_section

        add(mla_decode_section(device, ceil.copy_gbps, args.smoke))
        _free(device)
    if "prefill_kernel" not in skip:
        _, sec = gpu_attention.prefill_kernel_table(device, ceil, args.smoke)
        add(sec)
    if "layout" not in skip:
        from pd_cluster.bench.scripts import gpu_layout

        add(gpu_layout.layout_table(device, ceil, decode_cfg, num_sms, args.smoke))
        _free(device)
    if "decode_sweep" not in skip:
        add(gpu_attention.decode_sweep(device, ceil, num_sms, args.smoke))
        _free(device)
    if "quant_moe" not in skip:
        from pd_cluster.bench.scripts.gpu_quant_moe import quant_moe_table

        add(quant_moe_table(device, args.smoke, ceil))
        _free(device)
    return sections


def summary(sections: list[Section]) -> Section:
    """The acceptance targets, read back from the tables."""
    from pd_cluster.bench.scripts import gpu_flashinfer

    sec = Section("Summary against the targets", ["metric", "measured", "target"])
    by_title = {s.title.split(",")[0].split(" (")[0]: s for s in sections}
    dec = by_title.get("FP8 paged decode attention")
    if dec:
        vals = [r.cells[4] for r in dec.rows if r.cells[0] >= 32 and r.cells[1] >= 4096]
        if vals:
            sec.rows.append(Row(["decode attention, worst % of copy BW at batch >= 32, context >= 4k",
                                 min(vals), ">= 75"]))
    fi = next((s for s in sections if s.title == gpu_flashinfer.TITLE), None)
    if fi:
        sec.rows += gpu_flashinfer.summary_rows(fi)
    step = next((s for s in sections if s.title.startswith("Decode step")), None)
    if step:
        for r in step.rows:
            sec.rows.append(Row([f"decode step {r.cells[0]}, x floor", r.cells[3],
                                 "<= 1.3 with graphs" if r.cells[0] == "CUDA graph" else "-"]))
    pre = next((s for s in sections if s.title.startswith("Prefill of one")), None)
    if pre and pre.rows:
        sec.rows.append(Row(["prefill 8k chunk, % of bf16 matmul rate", pre.rows[0].cells[2], ">= 55"]))
    nx = next((s for s in sections if s.title.startswith("NIXL")), None)
    if nx:
        ok = [r.cells[4] for r in nx.rows if isinstance(r.cells[4], float)]
        sec.rows.append(Row(["NIXL VRAM->VRAM, best % of copy (bytes once)", max(ok) if ok else "n/a", ">= 70"]))
    return sec


def _emit(sec: Section) -> Section:
    print(sec.markdown(), flush=True)
    return sec


def _free(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Output:
    """The markdown file and its JSON twin, rewritten after every table so a run that is stopped keeps its tables."""

    def __init__(self, path: Path, header: str) -> None:
        self.path, self.header = path, header
        self.sections: list[Section] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def emit(self, sec: Section) -> None:
        _emit(sec)
        self.sections.append(sec)
        self.write()

    def write(self, footer: str = "\n(run in progress, or stopped before its end)\n") -> None:
        text = self.header + "\n" + "\n".join(s.markdown() for s in self.sections) + footer
        self.path.write_text(text)
        self.path.with_suffix(".json").write_text(json.dumps([s.to_dict() for s in self.sections], indent=1,
                                                             default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():  # the kernels can only run in Triton's interpreter; before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header = "## GPU benchmark\n\n" + device_info(device) + "\n"
    print(header, flush=True)
    out = Output(Path(args.output), header)
    sections = run(args, out.emit)
    out.emit(summary(sections))
    footer = f"\n(total wall time {time.perf_counter() - t0:.0f} s)\n"
    out.write(footer)
    print(f"wrote {out.path} and {out.path.with_suffix('.json')}{footer}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
