"""Acceptance: tiny random-weight models of every supported family match transformers.

fp32: last-position logits within 1e-4 relative (max |diff| / max |ref|).

FP8 E4M3 KV: the bound. E4M3 keeps 3 mantissa bits, so rounding a value
changes it by at most u = 2**-4 relative (normal range). The logit error this
causes depends on how the model amplifies KV errors, so the bound is set
against the same model's response to a known perturbation: K and V multiplied
by (1 + U(-u, u)), random relative errors of the same maximum size. FP8's
error must be at most 1.5x that (it is usually below it: most values round by
less than u), and at least 0.1x (the pool really quantises). A wrong scale,
a missing clamp or a layout bug gives errors far beyond it.
"""

from __future__ import annotations

import pytest
import torch
from random_models import FAMILIES, RelativeNoiseCache, build, engine_logits, hf_logits, row_rel_error

from pd_cluster.engine import LLM, SamplingParams

PROMPT_IDS = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()
FP8_U = 2.0 ** -4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_fp32(family, tmp_path):
    hf = build(family, tmp_path)
    with torch.no_grad():
        ref = hf_logits(hf, PROMPT_IDS)
    ours = engine_logits(tmp_path, PROMPT_IDS)
    last_rel = ((ours[-1] - ref[-1]).abs().max() / ref[-1].abs().max()).item()
    all_rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert last_rel < 1e-4, last_rel
    assert all_rel < 1e-4, all_rel


@pytest.mark.parametrize("family", ["llama-gqa4", "qwen2-bias-tied", "mixtral", "qwen3-moe", "phi3",
                                    "phi3-longrope-partial"])
def test_fp8_kv_error_within_bound(family, tmp_path, capsys):
    hf = build(family, tmp_path)
    x = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        ref = hf(x).logits[0]
        noise = [row_rel_error(hf(x, past_key_values=RelativeNoiseCache(FP8_U, s, config=hf.config)).logits[0], ref)
                 for s in range(3)]
    e_fp8 = row_rel_error(engine_logits(tmp_path, PROMPT_IDS, "fp8_e4m3"), ref)
    e_noise = sum(noise) / len(noise)
    with capsys.disabled():
        print(f"\n[{family}] FP8 KV relative logit error {e_fp8:.4f}; relative-noise(u=2^-4) baseline {e_noise:.4f}")
    assert 0.1 * e_noise < e_fp8 <= 1.5 * e_noise


@pytest.mark.parametrize("family", ["llama-gqa4", "qwen2-bias-tied", "mixtral", "qwen3-moe", "phi3"])
def test_fp8_greedy_agreement_reported(family, tmp_path, capsys):
    """Greedy agreement of FP8 vs fp32 KV over 64 tokens (reported; FP8 is not expected to be exact)."""
    build(family, tmp_path)
    prompts = [PROMPT_IDS[i * 20:(i + 1) * 20] for i in range(4)]
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ref = LLM(str(tmp_path), kv_cache_dtype="fp32").generate(prompts, greedy)
    fp8 = LLM(str(tmp_path), kv_cache_dtype="fp8_e4m3").generate(prompts, greedy)
    prefix = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b), 64)
              for o, r in zip(fp8, ref)]
    same = sum(a == b for o, r in zip(fp8, ref) for a, b in zip(o.token_ids, r.token_ids))
    with capsys.disabled():
        print(f"\n[{family}] FP8 vs fp32 greedy: identical prefix lengths {prefix} of 64; "
              f"{same}/{64 * len(prompts)} positions equal")
    assert all(len(o.token_ids) == 64 for o in fp8)
