"""Shared pieces of the GPU benchmark (`python -m pd_cluster.bench.scripts.gpu`): timing, ceilings, shapes, result rows.

Timing follows the device guide's method: device events around the region
(`triton.testing.do_bench`, median, L2 flushed before each call), warm-up
first. The two ceilings are measured on the device itself: a large
device-to-device copy (bytes read plus bytes written over time) and a large
bf16 matrix product on random data.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pd_cluster.engine.model.arch import ArchConfig

PLANNER_CONFIGS = Path(__file__).resolve().parents[2] / "engine" / "planner" / "configs"

# A Llama-shaped toy for `--smoke` runs on CPU (checks the script, measures nothing).
SMOKE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 512, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
}


def llama_config(smoke: bool) -> dict:
    """Llama-3.1-8B's public config (bundled for the planner), or the smoke toy."""
    if smoke:
        return dict(SMOKE_CONFIG)
    return json.loads((PLANNER_CONFIGS / "llama-3.1-8b.json").read_text())


def llama_arch(smoke: bool) -> ArchConfig:
    return ArchConfig.from_dict(llama_config(smoke))


def bench_ms(fn, device: torch.device, rep_ms: int = 200, warmup_ms: int = 50) -> float:
    """Median milliseconds of one call of `fn` (CUDA: do_bench with an L2 flush; CPU: wall clock)."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Ceilings:
    """The device's measured limits.

    Attributes:
        copy_gbps: device-to-device copy, (bytes read + bytes written) / time, GB/s (1e9).
        matmul_tflops: bf16 matrix product on random data, TFLOP/s (1e12).
    """

    copy_gbps: float
    matmul_tflops: float
    copy_bytes: int
    matmul_n: int


def measure_ceilings(device: torch.device, smoke: bool) -> Ceilings:
    """Copy bandwidth over a buffer well past the L2, and an N x N x N bf16 product (N = 8192)."""
    nbytes = (64 << 20) if smoke else (4 << 30)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, rep_ms=500)
    copy_gbps = 2 * nbytes / (ms * 1e-3) / 1e9
    del src, dst
    n = 256 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, device, rep_ms=1000)
    tflops = 2 * n ** 3 / (ms * 1e-3) / 1e12
    return Ceilings(copy_gbps, tflops, nbytes, n)


@dataclass
class Row:
    """One line of a result table; `cells` in column order."""

    cells: list
    note: str = ""


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        out = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
               "|" + "---|" * len(self.columns)]
        for r in self.rows:
            out.append("| " + " | ".join(_fmt(c) for c in r.cells) + " |")
        out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)


def pct(x: float, ceiling: float) -> float:
    return 100.0 * x / ceiling if ceiling else float("nan")
