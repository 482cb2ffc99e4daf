"""Long prompts on CPU: prefill time and peak memory of one long prompt on a tiny hybrid model.

    python -m pd_cluster.bench.scripts.long_context                       # 16k, 64k, 128k; cpu and torch
    python -m pd_cluster.bench.scripts.long_context --lengths 16384 --backends cpu
    python -m pd_cluster.bench.scripts.long_context --smoke               # checks the script (1k tokens)

The model is a tiny random Llama 4 text checkpoint written by transformers (hidden 64, 4 layers: 3 chunked-local
layers of Scout's 8,192-token chunk and 1 global NoPE layer, MoE on every second layer; 4 query and 2 KV heads of
16), with ``max_position_embeddings`` past the longest prompt. Each (backend, length) runs in a fresh process:
the engine loads (fp32 KV, 16-token pages, chunked prefill of 8,192 tokens, one CPU thread), then one request of
`length` random tokens generates one token. Reported: the prefill time (the request's wall time), the process's
peak resident memory during the request (Linux's ``VmHWM``, reset once the engine is ready; ``ru_maxrss`` of the
whole process where it cannot be reset) and its resident memory once the engine was ready (the difference is what
the prompt added: the KV pool was allocated at start-up, so it is the attention's and the step's own buffers), and
the most pages the request held in each KV group at once (the engine's hybrid KV manager: the global layer's group
holds every page, each chunked layer's group only its chunk plus the prefill chunk being computed).

For comparison the table gives, by arithmetic, the ``[heads, chunk, context]`` float32 scores the torch
reference built per layer before it ran in query blocks (the last chunk of the prompt against the whole context).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

PAGE, CHUNK_PREFILL, HEADS = 16, 8192, 4


def build_model(folder: Path, max_len: int) -> None:
    """Save the tiny Llama 4 checkpoint (module docstring) into `folder`."""
    import torch
    from transformers import AutoTokenizer, Llama4ForCausalLM, Llama4TextConfig

    from pd_cluster.engine.assets import DEFAULT_MODEL

    torch.manual_seed(0)
    cfg = Llama4TextConfig(vocab_size=512, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
                           num_hidden_layers=4, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                           attention_chunk_size=8192, no_rope_layer_interval=4, max_position_embeddings=max_len)
    Llama4ForCausalLM(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(folder)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS (Linux: ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(model: str, length: int, backend: str) -> dict:
    """In this process: load the engine, prefill one `length`-token prompt, return the measurements."""
    import numpy as np

    from pd_cluster.engine import LLM, SamplingParams

    kv_bytes = 4 * 2 * 2 * 16 * 4 * (length + 2 * PAGE)  # layers x K,V x kv heads x head_dim x fp32, whole prompt
    llm = LLM(model, attention_backend=backend, kv_cache_dtype="fp32", page_size=PAGE,
              chunked_prefill_size=CHUNK_PREFILL, context_length=length + 16, kv_cache_memory=kv_bytes + (8 << 20))
    engine = llm.engine
    prompt = np.random.default_rng(length).integers(3, 512, size=length).tolist()
    ready_rss = _rss_bytes()
    reset = _reset_peak()
    started = time.perf_counter()
    most = [0] * engine.kv_groups.num_groups
    pages, grow = engine.pages, engine.pages.grow

    def grow_and_count(r, num_tokens):  # a request holds the most pages right after it grows
        new = grow(r, num_tokens)
        held = pages.held_pages(r) if pages.grouped else [len(r.block_table)]
        most[:] = [max(a, b) for a, b in zip(most, held)]
        return new

    pages.grow = grow_and_count
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    req = engine.requests[rid]
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - started
    assert len(req.output_token_ids) == 1 and engine.num_free_pages() == engine.allocator.num_pages
    groups = [f"{g.kind}{'' if g.kind == 'full' else f'({g.rule[1]})'} x{len(g.layers)}"
              for g in engine.kv_groups.groups]
    return {"length": length, "backend": backend, "seconds": seconds, "peak_rss": _peak_bytes(), "ready_rss": ready_rss,
            "peak_since_ready": reset, "pages": most[0], "pages_by_group": list(zip(groups, most)),
            "layers": len(engine.loaded.model.layers)}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def old_scores_bytes(length: int) -> int:
    """float32 ``[heads, chunk, context]`` scores of the prompt's last chunk (the torch reference before query
    blocks), one layer."""
    chunk = min(CHUNK_PREFILL, length)
    return HEADS * chunk * length * 4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536, 131072])
    p.add_argument("--backends", nargs="+", default=["cpu", "torch"], choices=["cpu", "torch"])
    p.add_argument("--smoke", action="store_true", help="one 1,024-token prompt per backend")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "LENGTH", "BACKEND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.one[2])))
        return 0
    lengths = [1024] if args.smoke else args.lengths
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), max(lengths) + 64)
        for length in lengths:
            for backend in args.backends:
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                res = subprocess.run([sys.executable, "-m", "pd_cluster.bench.scripts.long_context", "--one", tmp,
                                      str(length), backend], capture_output=True, text=True, env=env, check=True)
                rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    print(f"Long prompts on CPU: tiny Llama 4 (4 layers: 3 chunked of 8,192, 1 global NoPE), fp32 KV, page {PAGE}, "
          f"chunked prefill {CHUNK_PREFILL}, 1 thread; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {date.today().isoformat()}\n")
    if not all(r["peak_since_ready"] for r in rows):
        print("(peak RSS is the whole process's ru_maxrss: VmHWM could not be reset here)\n")
    print("| prompt tokens | backend | prefill | peak RSS | RSS at ready | added by the prompt | most pages held "
          "per KV group | old torch scores, one layer (arithmetic) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        held = ", ".join(f"{g}: {n:,}" for g, n in r["pages_by_group"])
        print(f"| {r['length']:,} | {r['backend']} | {r['seconds']:.1f} s | {_gib(r['peak_rss'])} | "
              f"{_gib(r['ready_rss'])} | {_gib(r['peak_rss'] - r['ready_rss'])} | {held} | "
              f"{_gib(old_scores_bytes(r['length']))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
