"""NEXTN under tensor parallelism: the target's layers on two gloo ranks, the MTP layer whole on rank 0 (fed rank
0's final-norm output, the full hidden state after the last all-reduce). Greedy tokens equal transformers' greedy
loop and the engine without speculation, with an MTP layer whose drafts are mostly accepted and with a random one
(mostly rejected, each draft equal to a transformers recompute of the MTP layer); every page of both pools comes
back."""

from __future__ import annotations

import pytest
from deepseek_models import PROMPTS, hf_greedy_recompute, prompt_ids
from mtp_models import echo_mtp, random_mtp, record_drafts, reference_drafts

from pd_cluster.engine import LLM, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["echo", "random"])
def test_tp2_nextn_greedy_equals_transformers_and_no_speculation(tmp_path, kind):
    hf = (echo_mtp if kind == "echo" else random_mtp)(tmp_path)
    refs = [hf_greedy_recompute(hf, prompt_ids(p), MAX_NEW) for p in PROMPTS[:3]]
    plain = [o.token_ids for o in LLM(str(tmp_path), kv_cache_dtype="fp32").generate(PROMPTS[:3], GREEDY)]
    assert plain == refs
    llm = LLM(str(tmp_path), kv_cache_dtype="fp32", tp_size=2, page_size=4, chunked_prefill_size=7,
              speculative_algorithm="NEXTN", speculative_num_draft_tokens=3)
    try:
        eng = llm.engine
        mtp = eng.drafter.model
        assert eng.loaded.model.layers[0].self_attn.num_heads == 2  # the target: half of the 4 heads here
        assert mtp.model.loaded.model.layers[0].self_attn.num_heads == 4  # the MTP layer: whole on rank 0
        seen = record_drafts(mtp)
        assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == refs
        if kind == "random":  # every draft is a full recompute's in transformers (`reference_drafts`)
            assert len(seen) >= 8
            assert all(d == reference_drafts(hf, seq, len(d)) for seq, d in seen)
        spec = eng.stats.spec
        assert spec.num_drafts > 0 and mtp.num_no_hidden == 0
        if kind == "echo":
            assert spec.num_accepted_tokens > spec.num_draft_tokens // 2
        else:
            assert spec.num_accepted_tokens < spec.num_draft_tokens // 4
        alloc = mtp.model.allocator
        assert not mtp.seqs and alloc.num_free == alloc.num_pages
        assert eng.num_free_pages() == eng.allocator.num_pages
    finally:
        llm.engine.close()
