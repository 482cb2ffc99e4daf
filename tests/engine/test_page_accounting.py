"""Acceptance: after finished, aborted and retracted requests, every page is free again."""

from __future__ import annotations

from engine_reference import PROMPTS, hf_greedy

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.args import config_from_kwargs

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def test_tiny_pool_retracts_and_still_matches_reference(caplog):
    # 8 prompts of 19-42 tokens + 64 outputs need ~720 tokens; the pool holds 20 pages of 16 = 320.
    # Conservativeness 0.1 reserves little for future tokens, so admission overcommits and retraction must happen.
    llm = LLM(page_size=16, num_pages=20, schedule_conservativeness=0.1)
    engine = llm.engine
    with caplog.at_level("WARNING", logger="engine"):
        outs = llm.generate(PROMPTS, GREEDY_64)
    assert engine.scheduler.num_retracted_total > 0
    assert "KV cache pool is full. Retract requests. #retracted_reqs:" in caplog.text
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, "fp32"), prompt
    assert engine.num_free_pages() == engine.allocator.num_pages == 20
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def test_aborts_at_every_stage_free_everything():
    engine = LLMEngine(config_from_kwargs(page_size=16, num_pages=40, chunked_prefill_size=7,
                                          schedule_conservativeness=0.2))
    total = engine.allocator.num_pages
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS):
        engine.add_request(rid, prompt, GREEDY_64)
    finished = {}
    aborted_at = {"r0": 0, "r1": 2, "r2": 5, "r3": 30}  # queued, mid-prefill, just decoding, deep in decode
    for step in range(400):
        for rid, when in aborted_at.items():
            if step == when:
                engine.abort_request(rid)
        for d in engine.step().deltas:
            if d.finished:
                finished[d.request_id] = d.finish_reason
        if not engine.has_work():
            break
    assert set(finished) == set(ids)
    assert [finished[r] for r in aborted_at] == ["abort"] * 4
    assert all(finished[r] == "length" for r in ids if r not in aborted_at)
    assert engine.num_free_pages() == total
    assert not engine.requests


def test_pages_grow_on_demand():
    engine = LLMEngine(config_from_kwargs(page_size=16, num_pages=100))
    engine.add_request("a", list(range(3, 3 + 20)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill 20 tokens + first token
    req = engine.requests["a"]
    assert len(req.block_table) == 2  # 20 tokens -> 2 pages; nothing reserved for the 40 outputs
    used = []
    while engine.has_work():
        engine.step()
        if "a" in engine.requests:
            used.append(len(engine.requests["a"].block_table))
    assert max(used) == 4  # 20 + 40 = 60 tokens, 59 with KV -> 4 pages, taken one by one
    assert used == sorted(used)
    assert engine.num_free_pages() == 100
