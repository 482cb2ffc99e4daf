"""Offline throughput of the engine against transformers' batched `generate`, same prompts, same run.

Workload: the first 256 ShareGPT prompts shipped in ``bench/data/sharegpt_300.json``,
tokenized with the model's tokenizer and cut to at most ``--max-prompt-len`` tokens
(stories260K has a 512-token context). Output lengths: the reply lengths of
``bench/data/sharegpt_50_with_responses.json`` (cycled), divided by
``--output-scale`` and capped so prompt + output fit the context; every request
generates exactly its length (``ignore_eos``; transformers: the batch runs to its
longest request and each row is cut to its own length). Throughput counts only
each request's own tokens, for both.

Run: ``python -m pd_cluster.bench.scripts.engine_throughput`` (prints a table).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "data"


def workload(tokenizer, n: int, max_prompt: int, out_scale: float, context: int) -> list[tuple[list[int], int]]:
    prompts = json.loads((DATA / "sharegpt_300.json").read_text())[:n]
    replies = [r["response_tokens"] for r in json.loads((DATA / "sharegpt_50_with_responses.json").read_text())]
    items = []
    for i, p in enumerate(prompts):
        ids = tokenizer(p["conversations"][0]["value"]).input_ids[:max_prompt]
        out = max(8, min(int(replies[i % len(replies)] / out_scale), context - len(ids)))
        items.append((ids, out))
    return items


def run_engine(items, args) -> tuple[list[float], int]:
    from pd_cluster.engine import LLM, SamplingParams

    llm = LLM(kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size, cpu_threads=args.threads,
              max_running_requests=args.max_running_requests)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in items]
    llm.generate([ids for ids, _ in items[:4]], params[:4])  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = llm.generate([ids for ids, _ in items], params)
        times.append(time.perf_counter() - t)
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == sum(n for _, n in items)
    return times, tokens


def run_transformers(items, args, tokenizer) -> tuple[list[float], int]:
    from transformers import AutoModelForCausalLM

    from pd_cluster.engine.assets import DEFAULT_MODEL

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        tokens = _transformers_once(model, items, args, tokenizer.eos_token_id)
        times.append(time.perf_counter() - t)
    return times, tokens


def _transformers_once(model, items, args, pad: int) -> int:
    tokens = 0
    for start in range(0, len(items), args.hf_batch_size):
        batch = items[start:start + args.hf_batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        longest = max(n for _, n in batch)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        tokens += sum(min(n, out.shape[1] - width) for _, n in batch)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--output-scale", type=float, default=2.0)
    ap.add_argument("--hf-batch-size", type=int, default=256, help="transformers batch (256: all prompts at once, its fastest here)")
    ap.add_argument("--kv-cache-dtype", default="fp32")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each system; best and median reported")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pd_cluster.engine.assets import DEFAULT_MODEL

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    items = workload(tok, args.num_prompts, args.max_prompt_len, args.output_scale, 512)
    n_in = sum(len(i) for i, _ in items)
    n_out = sum(n for _, n in items)
    print(f"workload: {len(items)} ShareGPT prompts, {n_in} prompt tokens (mean {n_in / len(items):.0f}), "
          f"{n_out} output tokens (mean {n_out / len(items):.0f}); threads={args.threads}")
    e_times, e_tok = run_engine(items, args)
    rows = [("pd-cluster engine", e_times, e_tok, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)]
    if not args.skip_transformers:
        h_times, h_tok = run_transformers(items, args, tok)
        rows.append((f"transformers generate (batch {args.hf_batch_size})", h_times, h_tok,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    print("\n| system | best time (s) | median time (s) | output tokens | output tok/s (best) | total tok/s (best) "
          "| peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, times, tokens, rss in rows:
        best, med = min(times), statistics.median(times)
        print(f"| {name} | {best:.2f} | {med:.2f} | {tokens} | {tokens / best:,.0f} | {(tokens + n_in) / best:,.0f} "
              f"| {rss:,.0f} |")
    if len(rows) == 2:
        print(f"\nengine / transformers output throughput: {min(rows[1][1]) / min(rows[0][1]):.2f}x (best runs), "
              f"{statistics.median(rows[1][1]) / statistics.median(rows[0][1]):.2f}x (medians); "
              f"{args.repeats} timed runs each")
    print("(peak RSS is the process maximum so far: the transformers row includes the engine's peak)")


if __name__ == "__main__":
    main()
