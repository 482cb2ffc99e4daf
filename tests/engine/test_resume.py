"""Resumed output (``resume_token_ids``, the router's request migration): a request that starts after output an
earlier attempt generated continues exactly as the undisturbed run, token for token and character for character.

Checked on the real stories260K, in a mixed engine and across the prefill/decode handover (in one process: the
prefill engine's pages copied into the decode engine's), for what makes a continuation differ from a fresh
prompt: presence/frequency penalties (they count output tokens only), ``min_tokens``, a JSON-schema grammar (the
matcher replays the resumed tokens) and seeded sampling (the generator replays their draws), plus stop strings
held back at the cut.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine import SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.structured import StructuredOutput

PROMPT = "Once upon a time, there was a little dog named Max who"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["cat", "dog", "owl"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
    "required": ["name", "kind", "tags"], "additionalProperties": False}

CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40),
    "penalties": SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=1.5, frequency_penalty=1.0),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=40),
    "min_tokens": SamplingParams(temperature=1.0, seed=5, max_tokens=60, min_tokens=50),
    "json": SamplingParams(temperature=1.0, seed=3, max_tokens=120,
                           structured_output=StructuredOutput(json_schema=SCHEMA, param="response_format")),
    "stop": SamplingParams(temperature=0.0, max_tokens=60, stop=["was sad"]),
}


def _engine(role: str) -> LLMEngine:
    return LLMEngine(config_from_kwargs(role=role, page_size=4, chunked_prefill_size=7))


def _drain(engine: LLMEngine, rid: str, limit: int = 500):
    """(token ids, text, finish reason) of `rid`'s deltas until it finishes."""
    ids, text = [], []
    for _ in range(limit):
        for d in engine.step().deltas:
            if d.request_id == rid:
                ids += d.new_token_ids
                text.append(d.new_text)
                if d.finished:
                    return ids, "".join(text), d.finish_reason, d.num_output_tokens
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def mixed():
    return _engine("mixed")


@pytest.fixture(scope="module")
def references(mixed):
    out = {}
    for name, params in CASES.items():
        mixed.add_request(f"ref-{name}", PROMPT, params, stream=True)
        out[name] = _drain(mixed, f"ref-{name}")
    return out


def _delivered_text(engine: LLMEngine, params: SamplingParams, ids: list[int]) -> str:
    """The text a stream had delivered after `ids` (what the worker's `IncrementalDetokenizer.replay` marks sent)."""
    from pd_cluster.engine.detokenizer import IncrementalDetokenizer
    return IncrementalDetokenizer(engine.tokenizer, engine.tokenize(PROMPT), params.stop,
                                  params.include_stop_str_in_output, params.skip_special_tokens,
                                  params.min_tokens).replay(ids)


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_continuation_equals_the_undisturbed_run(mixed, references, name):
    ref_ids, ref_text, ref_reason, ref_n = references[name]
    assert len(ref_ids) >= 6, ref_ids
    for k in (1, len(ref_ids) // 2, len(ref_ids) - 1):
        rid = f"{name}-{k}"
        mixed.add_request(rid, PROMPT, CASES[name], stream=True, resumed_output_ids=ref_ids[:k])
        ids, text, reason, n = _drain(mixed, rid)
        assert ids == ref_ids[k:], (name, k)
        assert _delivered_text(mixed, CASES[name], ref_ids[:k]) + text == ref_text, (name, k)
        assert (reason, n) == (ref_reason, ref_n)  # the resumed tokens count as output


def _prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, rid: str, params: SamplingParams,
                         resumed: list[int]):
    """The PD handover in one process, with resumed output: prefill computes the KV of prompt + resumed tokens
    and samples the next one; its pages are copied into the pages decode reserved for all of them."""
    from pd_cluster.disagg.prefill_api import first_token_params

    prefill.add_request(rid, PROMPT, first_token_params(params, len(resumed)), resumed_output_ids=resumed)
    first, src = None, None
    for _ in range(100):
        out = prefill.step()
        src = next((p.block_table for p in out.prefill_progress if p.done), src)
        first = next((d.new_token_ids for d in out.deltas if d.finished), first)
        if first is not None and src is not None:
            break
    assert first is not None and len(first) == 1  # only the new token, not the resumed ones
    decode.add_remote_request(rid, prefill.tokenize(PROMPT), params, stream=True, resumed_output_ids=resumed)
    dst = None
    for _ in range(10):
        dst = next((pages for r, pages, *_ in decode.step().reserved if r == rid), dst)
        if dst is not None:
            break
    n_tokens = decode.requests[rid].num_tokens
    assert n_tokens == len(prefill.tokenize(PROMPT)) + len(resumed)
    n = -(-n_tokens // prefill.layout.page_size)
    assert len(dst) == n
    decode.pool.kv[torch.tensor(dst)] = prefill.pool.kv[torch.tensor(src[:n])]
    prefill.release_request(rid)
    req = decode.requests[rid]
    decode.runner.sampler.skip(req.params, req.generator)  # the prefill worker drew the first new token
    assert decode.complete_remote_prefill(rid, first[0])
    ids, text, reason, count = _drain(decode, rid)
    return first + ids[1:] if ids[:1] == first else None, text, reason, count


@pytest.mark.parametrize("name", ["penalties", "seeded", "json", "min_tokens"])
def test_pd_continuation_equals_the_undisturbed_run(references, name):
    prefill, decode = _engine("prefill"), _engine("decode")
    free = decode.num_free_pages(), prefill.num_free_pages()
    ref_ids, ref_text, ref_reason, ref_n = references[name]
    k = len(ref_ids) // 2
    ids, text, reason, n = _prefill_then_decode(prefill, decode, "r", CASES[name], ref_ids[:k])
    assert ids == ref_ids[k:]
    assert _delivered_text(decode, CASES[name], ref_ids[:k]) + text == ref_text
    assert (reason, n) == (ref_reason, ref_n)
    assert (decode.num_free_pages(), prefill.num_free_pages()) == free  # no page leaked on either side


def test_resumed_tokens_the_grammar_refuses_are_rejected_by_name(mixed, references):
    params = CASES["json"]
    bad = mixed.tokenize(" Hello")[-1:]  # a JSON object cannot begin with a word
    with pytest.raises(RequestRejected) as e:
        mixed.add_request("bad-grammar", PROMPT, params, stream=True, resumed_output_ids=bad)
    assert e.value.param == "resume_token_ids" and "resume_token_ids[0]" in str(e.value)
    ref_ids = references["json"][0]
    with pytest.raises(RequestRejected) as e:  # the whole object: nothing is left to generate
        mixed.add_request("done-grammar", PROMPT, params, stream=True, resumed_output_ids=ref_ids)
    assert e.value.param == "resume_token_ids"
    assert "bad-grammar" not in mixed.requests and "done-grammar" not in mixed.requests


def test_resume_past_max_tokens_and_out_of_vocab_are_rejected(mixed):
    with pytest.raises(RequestRejected, match="nothing is left to generate") as e:
        mixed.add_request("full", PROMPT, SamplingParams(max_tokens=3), resumed_output_ids=[5, 6, 7])
    assert e.value.param == "resume_token_ids"
    with pytest.raises(RequestRejected, match=r"must be in \[0,") as e:
        mixed.add_request("oov", PROMPT, SamplingParams(max_tokens=8), resumed_output_ids=[10 ** 6])
    assert e.value.param == "resume_token_ids"


def test_resumed_output_that_already_ended_is_rejected(mixed, references):
    ref_ids = references["greedy"][0]
    eos = mixed.eos_token_ids[0]
    with pytest.raises(RequestRejected, match="already ended") as e:  # EOS ends it (unless ignore_eos)
        mixed.add_request("eos", PROMPT, SamplingParams(max_tokens=40), stream=True,
                          resumed_output_ids=ref_ids[:3] + [eos])
    assert e.value.param == "resume_token_ids"
    mixed.add_request("eos-ignored", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), stream=True,
                      resumed_output_ids=ref_ids[:3] + [eos])
    assert _drain(mixed, "eos-ignored")[3] == 8
    with pytest.raises(RequestRejected, match="already ended") as e:  # so does a stop id
        mixed.add_request("stop-id", PROMPT, SamplingParams(max_tokens=40, stop_token_ids=[ref_ids[2]]),
                          stream=True, resumed_output_ids=ref_ids[:3])
    text = _delivered_text(mixed, CASES["greedy"], ref_ids[:6])
    word = text.split()[-1]
    with pytest.raises(RequestRejected, match="stop string") as e:  # and a stop string the resumed text holds
        mixed.add_request("stop-str", PROMPT, SamplingParams(max_tokens=40, stop=[word]), stream=True,
                          resumed_output_ids=ref_ids[:6])
    assert e.value.param == "resume_token_ids"
    assert not {"eos", "stop-id", "stop-str"} & set(mixed.requests)
