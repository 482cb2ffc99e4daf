"""The end-to-end step of the GPU first contact (`first_contact`): greedy text on four models, offline and through
a 1P1D cluster on the one device, equal to the engine's torch reference.

Models (`first_contact_models`): the embedded stories260K, and tiny random Mixtral (fused MoE), DeepSeek-V3 (MLA
and MoE) and Gemma 3 (sliding windows: KV cache groups) checkpoints written by transformers. For each, in float32
weights and KV, page 16:

1. **Offline**: the engine with the CUDA defaults (Triton backend with its fused layer ops, CUDA graphs, overlap
   scheduling) must give the same tokens as the torch reference backend without graphs or overlap (a check).
   Both are shown against transformers' own greedy loop on CPU (full recompute), and stories260K's first prompt
   against the continuation Karpathy published for it (a check).
2. **PD**: a 1P1D cluster per model (router, prefill and decode workers, NIXL between them), each started as
   soon as its checkpoint is written, so all four come up together while the offline checks run, on the one
   device (``--kv-cache-memory`` each); every completion through the router must give the offline torch
   reference's token ids (a check; texts are compared and shown too).
3. stories260K in bf16 weights with FP8 KV, Triton against torch: leading tokens that agree (reported, not a
   check: rounding differs by path), on a GPU only.

``--dry-run``: CPU, two prompts, four tokens; the "fast" engine there is the torch backend with overlap
scheduling (Triton's interpreter would take minutes; `first_contact_kernels` runs the kernels there).
"""

from __future__ import annotations

import gc
import json
import sys
import time

from pd_cluster.bench.scripts import first_contact_pd as pd
from pd_cluster.bench.scripts.first_contact_models import TINY, build, hf_greedy
from pd_cluster.bench.scripts.first_contact_part import Part, finish, start_part
from pd_cluster.bench.scripts.gpu_common import Row, Section

PROMPTS = [
    "Once upon a time",
    "Once upon a time, there was a little dog named Max who",
    "The sun was shining and the birds were singing in the tall green trees.",
    "Lily and Tom went to the park with their mom. They wanted to",
    "One day, a little bird flew down from the sky and landed on",
    "Sam had a red ball. He liked to throw it high in the air, but one day",
    "Mom said, \"Let's go to the store and buy some",
    "Anna found a shiny key under her bed. She wondered what it could open, so she",
]
# Karpathy's published temperature-0 sample of stories260K (llama2.c doc/stories260K.md), from "Once upon a time"
PUBLISHED = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."
STORIES = "stories260K"


def generate(folder: str, device: str, prompts: list[str], max_tokens: int, **engine_args):
    """Greedy (ids, texts, prompt ids, wall seconds with start-up) of `prompts` from one offline engine."""
    import torch

    from pd_cluster.engine import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=folder, device=device, dtype=engine_args.pop("dtype", "float32"), page_size=16,
              kv_cache_memory="1GiB" if device == "cuda" else "64MiB", **engine_args)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    res = ([list(o.token_ids) for o in outs], [o.text for o in outs], [list(o.prompt_token_ids) for o in outs],
           time.perf_counter() - t0)
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def agree(a: list[int], b: list[int]) -> int:
    """Leading tokens on which `a` and `b` agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def offline(part: Part, name: str, folder: str, hf_model, device: str, prompts: list[str], max_tokens: int,
            dry: bool) -> tuple[list[list[int]], list[str]]:
    """Check 1 for one model; returns the torch reference's token ids and texts (the PD check's reference)."""
    ref = dict(attention_backend="torch", disable_cuda_graph=True, disable_overlap_schedule=True)
    fast = (dict(attention_backend="triton") if not dry  # the CUDA defaults: graphs and overlap on
            else dict(attention_backend="torch", disable_cuda_graph=True, enable_overlap_schedule=True))
    ref_ids, ref_texts, prompt_ids, t_ref = generate(folder, device, prompts, max_tokens, kv_cache_dtype="fp32",
                                                     **ref)
    fast_ids, _, _, t_fast = generate(folder, device, prompts, max_tokens, kv_cache_dtype="fp32", **fast)
    if hf_model is None:  # stories260K: transformers' own copy of the embedded checkpoint
        import torch
        from transformers import AutoModelForCausalLM
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = hf_greedy(hf_model, prompt_ids, max_tokens)
    fast_name = "Triton + graphs + overlap" if not dry else "torch + overlap (dry run)"
    sec = Section(f"{name}: offline greedy, float32, page 16, on {device}",
                  ["prompt", "prompt tokens", "tokens", f"leading equal: {fast_name} vs torch ref",
                   "leading equal: torch ref vs transformers"])
    for i, (a, b, h) in enumerate(zip(fast_ids, ref_ids, hf)):
        sec.rows.append(Row([i, len(prompt_ids[i]), len(a), agree(a, b), agree(b, h)]))
    sec.notes.append(f"wall with start-up: torch ref {t_ref:.1f} s, {fast_name} {t_fast:.1f} s; transformers: "
                     f"full recompute on CPU, {'equal' if hf == ref_ids else 'NOT equal'} to the torch reference")
    part.section(sec)
    part.check(f"{name}: offline {fast_name} == torch reference", fast_ids == ref_ids,
               f"{sum(a == b for a, b in zip(fast_ids, ref_ids))} of {len(ref_ids)} prompts equal")
    part.info(f"{name}: torch ref == transformers", hf == ref_ids)
    if name == STORIES:
        first = ref_texts[0]
        ok = first.startswith(PUBLISHED) if len(first) >= len(PUBLISHED) else PUBLISHED.startswith(first)
        part.check("stories260K: torch reference == the published llama2.c sample", ok, json.dumps(first[:120]))
    return ref_ids, ref_texts


def served_precision(part: Part, device: str, max_tokens: int) -> None:
    """Check 3 (informational): stories260K in bf16 with FP8 KV, Triton + graphs + overlap against torch."""
    from pd_cluster.engine.assets import DEFAULT_MODEL

    common = dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    b_ref = generate(DEFAULT_MODEL, device, PROMPTS, max_tokens, attention_backend="torch", disable_cuda_graph=True,
                     disable_overlap_schedule=True, **common)[0]
    b_tri = generate(DEFAULT_MODEL, device, PROMPTS, max_tokens, attention_backend="triton", **common)[0]
    sec = Section("stories260K: bf16 weights, FP8 E4M3 KV (informational: rounding differs by path)",
                  ["prompt", "leading equal: Triton + graphs + overlap vs torch ref"],
                  [Row([i, agree(a, b)]) for i, (a, b) in enumerate(zip(b_tri, b_ref))])
    part.section(sec)


def engine_argv(folder: str, dry: bool) -> list[str]:
    argv = ["--model", folder, "--dtype", "float32", "--kv-cache-dtype", "fp32", "--page-size", "16",
            "--kv-cache-memory", "64MiB" if dry else "256MiB"]
    return argv + (["--cpu-threads", "1"] if dry else [])


def pd_checks(part: Part, clusters: dict, refs: dict, prompts: list[str], tokens: dict, deadline: float) -> None:
    sec = Section("PD: 1P1D on the one device through the router, float32, against the offline torch reference",
                  ["model", "ready after (s)", "completions (s)", "token ids equal", "texts equal"])
    for name, cluster in clusters.items():
        with part.guard(f"{name}: PD 1P1D"):
            try:
                ready = pd.wait_ready(cluster, deadline)
                t0 = time.monotonic()
                texts, ids = pd.complete(cluster, name, prompts, tokens[name], timeout_s=max(10.0, deadline - t0))
            except Exception:
                print(pd.tails(cluster), flush=True)  # the workers' last lines, into the run's log
                sec.rows.append(Row([name, "failed", "", "", ""]))
                part.check(f"{name}: PD 1P1D == offline torch reference", False, "the cluster failed (see errors)")
                raise
            want_ids, want_texts = refs.get(name) or ([], [])
            same_ids = sum(a == b for a, b in zip(ids, want_ids))
            same_texts = sum(a == b for a, b in zip(texts, want_texts))
            sec.rows.append(Row([name, ready, time.monotonic() - t0, f"{same_ids} of {len(ids)}",
                                 f"{same_texts} of {len(texts)}"]))
            part.check(f"{name}: PD 1P1D == offline torch reference", bool(want_ids) and same_ids == len(ids),
                       f"{same_ids} of {len(ids)} token sequences equal" + ("" if want_ids else " (no reference)"))
            for i, (got, exp, gid, eid) in enumerate(zip(texts, want_texts, ids, want_ids)):
                if got != exp or gid != eid:
                    sec.notes.append(f"{name} prompt {i}: tokens {'equal' if gid == eid else 'DIFFER'}; text got "
                                     f"{json.dumps(got[:80])}, offline {json.dumps(exp[:80])}")
    part.section(sec)


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "e2e", __doc__)
    dry = args.dry_run
    device = args.device.type
    prompts = PROMPTS if not dry else PROMPTS[:2]
    tokens = {name: (64 if name == STORIES else 32) if not dry else 4 for name in (STORIES, *TINY)}
    from pd_cluster.engine.assets import DEFAULT_MODEL
    folders, hf_models = {STORIES: DEFAULT_MODEL}, {}
    deadline = time.monotonic() + max(30.0, part.left_s() - 25)  # keep time to stop the clusters
    clusters: dict = {}
    try:
        with part.guard(f"{STORIES}: start a 1P1D cluster"):  # first: it comes up while the others are built
            clusters[STORIES] = pd.start(engine_argv(DEFAULT_MODEL, dry), log_level="warning")
        for name in TINY:
            with part.guard(f"{name}: build the checkpoint, start a 1P1D cluster"):
                hf_models[name] = build(name, args.work / "e2e-models" / name)
                folders[name] = str(args.work / "e2e-models" / name)
                clusters[name] = pd.start(engine_argv(folders[name], dry), log_level="warning")
        refs = {}
        for name, folder in folders.items():
            with part.guard(f"{name}: offline"):
                refs[name] = offline(part, name, folder, hf_models.get(name), device, prompts, tokens[name], dry)
        pd_checks(part, clusters, refs, prompts, tokens, deadline)
    finally:
        pd.stop_all(clusters.values())
    if device == "cuda":
        with part.guard("stories260K: bf16 / FP8 KV"):
            served_precision(part, device, tokens[STORIES])
    return finish(part)


if __name__ == "__main__":
    sys.exit(main())
