"""Overlap scheduling (`pd_cluster.engine.overlap`) on the real stories260K: the tokens, texts, finish reasons
and logprobs of every request equal the engine's without it, and every page comes back.

Off CUDA nothing overlaps in time, but the bookkeeping is the CUDA path's: step N+1 is scheduled and issued
before step N's tokens are read, its decodes take their input token from step N's device tensor, requests
stopped by step N's token run one more step whose token is dropped, and requests whose sampling needs their
previous token on the host make the engine complete the step in flight first.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.sampling.structured import StructuredOutput
from pd_cluster.disagg.prefill_api import first_token_params

PROMPTS = [
    "Once upon a time",
    "Lily and Ben went to the park. They saw a big dog",
    "The cat sat on the mat and",
    "One day, a little bird",
    "Tom had a red ball. He",
    "Sue liked to play in the garden with her mom. One day",
]

PLAIN = {  # nothing that reads previous tokens on the host: these overlap
    "greedy": SamplingParams(temperature=0.0, max_tokens=48),
    "short": SamplingParams(temperature=0.0, max_tokens=1),
    "two": SamplingParams(temperature=0.0, max_tokens=2),
    "eos": SamplingParams(temperature=0.0, max_tokens=200),  # stops at EOS: one extra step, its token dropped
    "stop_str": SamplingParams(temperature=0.0, max_tokens=60, stop=["was sad", " the"]),
    "stop_id": SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[267]),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=40),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=40),
    "min_tokens": SamplingParams(temperature=1.0, seed=5, max_tokens=60, min_tokens=50),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=30, logprobs=3),
}
HOST = {  # read their previous tokens on the host: the step in flight completes first
    "penalties": SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=1.5, frequency_penalty=1.0),
    "json": SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured_output=StructuredOutput(
        json_schema={"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                     "required": ["name"], "additionalProperties": False}, param="response_format")),
}


def _engine(overlap: bool, role: str = "mixed", **kw) -> LLMEngine:
    kw.setdefault("page_size", 4)
    kw.setdefault("chunked_prefill_size", 16)
    return LLMEngine(config_from_kwargs(role=role, enable_overlap_schedule=overlap,
                                        disable_overlap_schedule=not overlap, **kw))


def _run(engine: LLMEngine, cases: dict[str, SamplingParams], stream: bool = True, limit: int = 3000) -> dict:
    """Every case on every prompt at once; per request: (token ids, text, finish reason, logprobs)."""
    out: dict[str, list] = {}
    for name, params in cases.items():
        for i, prompt in enumerate(PROMPTS):
            rid = f"{name}-{i}"
            engine.add_request(rid, prompt, params, stream=stream)
            out[rid] = [[], [], None, []]
    for _ in range(limit):
        if not engine.has_work():
            break
        for d in engine.step().deltas:
            rec = out[d.request_id]
            assert rec[2] is None, f"{d.request_id}: a delta after its last"
            rec[0] += d.new_token_ids
            rec[1].append(d.new_text)
            rec[3] += d.new_logprobs or []
            if d.finished:
                rec[2] = d.finish_reason
    else:
        raise AssertionError("the engine did not finish")
    return {rid: (ids, "".join(text), reason, lps) for rid, (ids, text, reason, lps) in out.items()}


def _assert_idle(engine: LLMEngine) -> None:
    assert engine.overlap.in_flight is None
    assert not engine.requests
    assert engine.num_free_pages() == engine.allocator.num_pages  # no page leaked


@functools.lru_cache(maxsize=None)
def _reference(page_size: int) -> dict:
    """The same requests without overlap scheduling (float sums depend on the page size: one per size)."""
    eng = _engine(False, page_size=page_size)
    assert not eng.overlap.enabled and eng.overlap.describe() == "off (--disable-overlap-schedule)"
    return _run(eng, PLAIN | HOST)


@pytest.fixture(scope="module")
def reference():
    return _reference(4)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_overlap_equals_the_engine_without_it(page_size):
    reference = _reference(page_size)
    eng = _engine(True, page_size=page_size)
    assert eng.overlap.enabled and eng.overlap.describe().startswith("on")
    got = _run(eng, PLAIN)
    for rid, rec in got.items():
        assert rec == reference[rid], rid
    assert {r[2] for r in got.values()} == {"length", "stop"}
    assert eng.overlap.num_overlapped > 100 and eng.overlap.num_drains == 0
    # the generation counter counts delivered tokens, not the dropped ones of requests stopped in flight
    assert eng.stats.generation_tokens_total == sum(len(r[0]) for r in got.values())
    _assert_idle(eng)


def test_requests_that_need_host_tokens_complete_the_step_in_flight_first(reference):
    eng = _engine(True)
    got = _run(eng, PLAIN | HOST)
    for rid, rec in got.items():
        assert rec == reference[rid], rid
    assert eng.overlap.num_drains > 0 and eng.overlap.num_overlapped > 0
    _assert_idle(eng)


def test_non_streaming_requests_equal_too(reference):
    eng = _engine(True)
    got = _run(eng, PLAIN, stream=False)
    for rid, (ids, text, reason, lps) in got.items():
        assert (ids, text, reason) == reference[rid][:3], rid
    _assert_idle(eng)


def test_retraction_with_a_step_in_flight(reference):
    """A pool too small for the batch: requests are retracted (some while their token is in flight) and
    recomputed; their tokens still equal the reference."""
    eng = _engine(True, kv_cache_memory="200KiB")
    got = _run(eng, {k: PLAIN[k] for k in ("greedy", "seeded", "stop_str", "logprobs")})
    assert eng.scheduler.num_retracted_total > 0
    for rid, rec in got.items():  # logprobs: a recomputed prompt sums in other chunks (last-bit differences)
        assert rec[:3] == reference[rid][:3], rid
    _assert_idle(eng)


def test_abort_with_a_step_in_flight(reference):
    eng = _engine(True)
    params = PLAIN["greedy"]
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"greedy-{i}", prompt, params, stream=True)
    got: dict[str, list[int]] = {f"greedy-{i}": [] for i in range(len(PROMPTS))}
    finished: dict[str, str] = {}
    for step in range(400):
        if step == 12:  # decodes under way: abort two requests whose next token is in flight
            assert [eng.requests[r].num_inflight for r in ("greedy-1", "greedy-4")] == [1, 1]
            assert eng.abort_request("greedy-1") and eng.abort_request("greedy-4")
        if not eng.has_work():
            break
        for d in eng.step().deltas:
            assert d.request_id not in finished
            got[d.request_id] += d.new_token_ids
            if d.finished:
                finished[d.request_id] = d.finish_reason
    assert finished["greedy-1"] == finished["greedy-4"] == "abort"
    for rid in set(got) - {"greedy-1", "greedy-4"}:
        assert (got[rid], finished[rid]) == (reference[rid][0], reference[rid][2]), rid
    for rid in ("greedy-1", "greedy-4"):
        assert got[rid] == reference[rid][0][:len(got[rid])] and len(got[rid]) < len(reference[rid][0])
    assert eng.stats.generation_tokens_total == sum(len(ids) for ids in got.values())
    _assert_idle(eng)


def test_decode_role_with_pages_from_a_prefill_engine(reference):
    """The PD handover in one process (prefill pages copied into the decode engine's reserved pages); the
    decode engine overlaps its steps."""
    prefill, decode = _engine(False, role="prefill"), _engine(True, role="decode")
    assert decode.overlap.enabled and not prefill.overlap.enabled
    cases = {"greedy": PLAIN["greedy"], "seeded": PLAIN["seeded"], "eos": PLAIN["eos"]}
    first: dict[str, int] = {}
    src: dict[str, list[int]] = {}
    for name, params in cases.items():
        for i, prompt in enumerate(PROMPTS):
            prefill.add_request(f"{name}-{i}", prompt, first_token_params(params))
    for _ in range(500):
        if not prefill.has_work():
            break
        out = prefill.step()
        src.update({p.request_id: p.block_table for p in out.prefill_progress if p.done})
        first.update({d.request_id: d.new_token_ids[0] for d in out.deltas if d.finished})
    assert len(first) == len(src) == len(cases) * len(PROMPTS)
    got: dict[str, list[int]] = {}
    for name, params in cases.items():
        for i, prompt in enumerate(PROMPTS):
            rid = f"{name}-{i}"
            decode.add_remote_request(rid, prefill.tokenize(prompt), params, stream=True)
            got[rid] = []
    reserved: dict[str, list[int]] = {}
    ended: dict[str, str] = {}
    for _ in range(2000):
        if not decode.has_work():
            break
        out = decode.step()
        for rid, pages, _cached, _groups in out.reserved:
            n = len(pages)
            decode.pool.kv[torch.tensor(pages)] = prefill.pool.kv[torch.tensor(src[rid][:n])]
            prefill.release_request(rid)
            req = decode.requests[rid]
            decode.runner.sampler.skip(req.params, req.generator)  # the prefill worker drew the first token
            assert decode.complete_remote_prefill(rid, first[rid])
            reserved[rid] = pages
        for d in out.deltas:
            got[d.request_id] += d.new_token_ids
            if d.finished:
                ended[d.request_id] = d.finish_reason
    assert len(reserved) == len(got)
    for rid, ids in got.items():
        assert (ids, ended[rid]) == (reference[rid][0], reference[rid][2]), rid
    assert decode.overlap.num_overlapped > 0
    _assert_idle(decode)
    assert prefill.num_free_pages() == prefill.allocator.num_pages


@pytest.mark.slow
def test_tensor_parallel_ranks_take_the_tokens_in_flight_from_rank_0():
    """TP 2: the packed step names its future tokens and rank 0 broadcasts the sampled ids on the device group;
    both ranks' inputs must hold them, or the all-reduced outputs differ from the engine without overlap."""
    cases = {k: PLAIN[k] for k in ("greedy", "eos", "stop_str", "seeded", "logprobs")}
    outs = []
    for overlap in (False, True):
        eng = _engine(overlap, tp_size=2, page_size=16)
        try:
            assert eng.overlap.enabled == overlap
            outs.append(_run(eng, cases))
            if overlap:
                assert eng.overlap.num_overlapped > 50
                _assert_idle(eng)
        finally:
            eng.close()
    assert outs[0] == outs[1]


def test_overlap_flags():
    from pd_cluster.engine.overlap import overlap_mode

    def mode(device: str, **kw) -> tuple[bool, str]:
        return overlap_mode(config_from_kwargs(**kw), device)

    assert mode("cuda") == (True, "on")
    assert mode("cuda", disable_overlap_schedule=True) == (False, "off (--disable-overlap-schedule)")
    assert mode("cuda", role="prefill") == (False, "off (prefill role)")
    assert mode("cpu") == (False, "off (no CUDA)")
    assert mode("cpu", enable_overlap_schedule=True)[0]
    assert mode("cuda", tp_size=2) == (True, "on")
    with pytest.raises(ValueError, match="exclusive"):
        config_from_kwargs(enable_overlap_schedule=True, disable_overlap_schedule=True)


@pytest.mark.gpu
def test_an_overlapped_step_never_waits_for_the_device():
    """On CUDA, issuing a step (batch upload, forward or graph replay, sampling, the token copy) makes no
    synchronising call, so the engine thread runs ahead of the GPU; torch's sync debug mode raises on one."""
    eng = _engine(True, page_size=16)
    cases = {k: PLAIN[k] for k in ("greedy", "seeded", "min_tokens", "logprobs")}
    for name, params in cases.items():
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(f"{name}-{i}", prompt, params, stream=True)
    launch = eng.runner.launch
    checked = []

    def strict_launch(sched, prev=None, started=0.0):
        if not sched.prefills and prev is not None:  # decode steps overlap the one in flight
            torch.cuda.set_sync_debug_mode("error")
            try:
                checked.append(sched.num_tokens)
                return launch(sched, prev, started)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return launch(sched, prev, started)

    eng.runner.launch = strict_launch
    for _ in range(500):
        if not eng.has_work():
            break
        eng.step()
    assert len(checked) > 20
    _assert_idle(eng)
