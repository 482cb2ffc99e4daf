"""Structured outputs (xgrammar): the token mask makes the embedded stories260K, which has never seen JSON,
produce outputs that match a JSON schema, a regex, a choice or any JSON object; on every token, including the
first one that a prefill-role engine samples and a decode-role engine replays into its matcher; across
retraction.

The tiny model rambles inside free strings (it writes stories), so the schema bounds its strings with
``maxLength``; the grammar then forces each string closed and the object to finish well within max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from engine_reference import PROMPTS

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.errors import SamplingParamError
from pd_cluster.engine.sampling.structured import StructuredOutput

SCHEMA = {  # nested objects, enums, arrays, bounded numbers; nothing like it is in TinyStories
    "type": "object",
    "properties": {
        "hero": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 10},
                "species": {"enum": ["cat", "dog", "owl", "dragon"]},
                "age": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["name", "species", "age"],
            "additionalProperties": False,
        },
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "mood": {"enum": ["happy", "sad", "brave"]},
        "happy_end": {"type": "boolean"},
    },
    "required": ["hero", "friends", "mood", "happy_end"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput(json_schema=SCHEMA, param="response_format")
PROMPT = "Once upon a time, there was a little dog named Max who"


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _sampled(seed: int, spec: StructuredOutput = JSON_SPEC, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 200), structured_output=spec,
                          **kw)


def test_json_schema_20_seeded_samples_at_temperature_1_all_validate(llm):
    outs = llm.generate([PROMPT] * 20, [_sampled(seed) for seed in range(20)])
    texts = []
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
        texts.append(o.text)
    assert len(set(texts)) >= 15  # really sampled, not one forced string
    # Without the constraint the same requests do not produce JSON: the mask is what makes it valid.
    free = llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=80) for s in range(4)])
    for out in free:
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.outputs[0].text)


def test_choice_returns_only_the_choices(llm):
    choices = ["yes", "no", "maybe later", "ask \"Mom\""]
    spec = StructuredOutput(choice=choices)
    outs = llm.generate([PROMPTS[i % 4] for i in range(16)], [_sampled(s, spec, max_tokens=20) for s in range(16)])
    got = [o.outputs[0].text for o in outs]
    assert set(got) <= set(choices), got
    assert len(set(got)) >= 2, got
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_regex_outputs_fullmatch(llm):
    pattern = r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,2} years old\."
    spec = StructuredOutput(regex=pattern)
    outs = llm.generate([PROMPT] * 8, [_sampled(s, spec, max_tokens=40) for s in range(8)])
    for out in outs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_json_object_output_parses(llm):
    """Any JSON object. Left alone, stories260K writes one endless story inside the first key string (no schema
    bounds it), so a logits processor plays a model that wants to close: after 12 tokens it favours '"' (+30)
    over '}' (+20). Inside a string '"' closes it; after a value only ',' or '}' are allowed and '}' wins. The
    mask still decides what is legal: the processor runs before it."""
    tok = llm.get_tokenizer()
    quote = [i for i in range(tok.vocab_size) if tok.decode([i]) == '"']
    brace = [i for i in range(tok.vocab_size) if tok.decode([i]) == "}"]

    def wants_to_close(out, logits):
        if len(out) >= 12:
            logits[quote] += 30.0
            logits[brace] += 20.0
        return logits

    spec = StructuredOutput(json_object=True)
    outs = llm.generate([PROMPT] * 4, [SamplingParams(temperature=t, seed=s, max_tokens=200, structured_output=spec,
                                                      logits_processors=[wants_to_close])
                                       for t, s in [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)
    # The same processor without the mask does not make JSON.
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, logits_processors=[wants_to_close]))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free[0].outputs[0].text)


def test_greedy_constrained_outputs_are_reproducible_and_batch_independent(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=200, structured_output=JSON_SPEC)
    alone = llm.generate([PROMPT], greedy)[0].outputs[0].text
    compiled = llm.engine.grammars.num_compiled
    mixed = llm.generate([PROMPTS[1], PROMPT, PROMPTS[2]],
                         [SamplingParams(temperature=1.0, seed=5, max_tokens=30), greedy, _sampled(3)])
    assert mixed[1].outputs[0].text == alone == llm.generate([PROMPT], greedy)[0].outputs[0].text
    jsonschema.validate(json.loads(alone), SCHEMA)
    same = StructuredOutput(json_schema=json.dumps(SCHEMA), param="guided_json")  # equal content, other field
    assert llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=200,
                                                 structured_output=same))[0].outputs[0].text == alone
    assert llm.engine.grammars.num_compiled == compiled  # one compile per schema (cached by content)


@pytest.mark.parametrize("make, param", [
    (lambda: StructuredOutput(json_schema={"type": "frobnicate"}, param="response_format"), "response_format"),
    (lambda: StructuredOutput(json_schema="{not json"), "guided_json"),
    (lambda: StructuredOutput(json_schema=[1, 2]), "guided_json"),
    (lambda: StructuredOutput(regex="(unclosed"), "guided_regex"),
    (lambda: StructuredOutput(regex=""), "guided_regex"),
    (lambda: StructuredOutput(choice=[]), "guided_choice"),
    (lambda: StructuredOutput(choice=["a", 3]), "guided_choice"),
    (lambda: StructuredOutput(grammar="root ::= ("), "guided_grammar"),
    (lambda: StructuredOutput(json_object=True, regex="a"), "structured_output"),
    (lambda: StructuredOutput(), "structured_output"),
    (lambda: SamplingParams(structured_output={"json": {}}), "structured_output"),
])
def test_bad_specs_raise_naming_the_field(make, param):
    with pytest.raises(SamplingParamError) as e:
        make()
    assert e.value.param == param
    assert str(e.value).startswith(param)


@pytest.mark.parametrize("spec", [JSON_SPEC, StructuredOutput(choice=["a", "b c"]), StructuredOutput(regex="[0-9]+"),
                                  StructuredOutput(json_object=True, any_whitespace=True),
                                  StructuredOutput(grammar='root ::= "x" | "y"')])
def test_params_cross_a_process_boundary_as_json(spec):
    """A decode worker sends `dataclasses.asdict(params)` as JSON to the prefill worker, which rebuilds them."""
    params = SamplingParams(temperature=0.5, seed=3, structured_output=spec)
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(params))))
    assert again.structured_output == spec and again.structured_output.param == spec.param
    assert again == params


def test_specs_compare_by_content():
    a = StructuredOutput(json_schema={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput(json_schema='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b) and a.kind == "json_schema"
    assert StructuredOutput(choice=["a", "b"]) != StructuredOutput(choice=["b", "a"])


def _engine(role: str, **kw) -> LLMEngine:
    return LLMEngine(config_from_kwargs(role=role, page_size=16, **kw))


def _run(engine: LLMEngine, limit: int = 400) -> dict:
    done = {}
    for _ in range(limit):
        for d in engine.step().deltas:
            if d.finished:
                done[d.request_id] = d
        if not engine.has_work():
            return done
    raise AssertionError("the engine did not finish")


def _prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, rid: str, params: SamplingParams):
    """The PD handover in one process: prefill samples the first token, its KV pages are copied into the pages
    the decode engine reserved, and the decode engine completes the remote prefill (replaying the token)."""
    prefill.add_request(rid, PROMPT, params)
    first, src_pages = None, None
    for _ in range(50):
        out = prefill.step()
        for p in out.prefill_progress:
            if p.done:
                src_pages = p.block_table
        for d in out.deltas:
            if d.finished:
                first = d.new_token_ids[0]
        if first is not None and src_pages is not None:
            break
    ids = prefill.tokenize(PROMPT)
    decode.add_remote_request(rid, ids, params)
    dst_pages = None
    for _ in range(10):
        for r, pages, *_ in decode.step().reserved:
            dst_pages = pages if r == rid else dst_pages
        if dst_pages is not None:
            break
    n = -(-len(ids) // prefill.layout.page_size)
    decode.pool.kv[torch.tensor(dst_pages[:n])] = prefill.pool.kv[torch.tensor(src_pages[:n])]
    prefill.release_request(rid)
    req = decode.requests[rid]
    decode.runner.sampler.skip(req.params, req.generator)  # what the decode worker does for a seeded request
    assert decode.complete_remote_prefill(rid, first)
    return first, _run(decode)[rid]


def test_prefill_first_token_is_masked_and_the_decode_replay_gives_the_mixed_text(llm):
    prefill, decode = _engine("prefill"), _engine("decode")
    for i, params in enumerate([SamplingParams(temperature=0.0, max_tokens=200, structured_output=JSON_SPEC),
                                _sampled(7), _sampled(11)]):
        mixed = llm.generate([PROMPT], params)[0].outputs[0]
        first, delta = _prefill_then_decode(prefill, decode, f"r{i}", params)
        assert first == mixed.token_ids[0]
        assert prefill.tokenizer.decode([first]).strip() == "{"  # the mask applied to the prefill worker's token
        assert delta.new_token_ids == mixed.token_ids and delta.new_text == mixed.text
        assert delta.finish_reason == "stop"
        jsonschema.validate(json.loads(delta.new_text), SCHEMA)
    assert prefill.num_free_pages() == prefill.allocator.num_pages
    assert decode.num_free_pages() == decode.allocator.num_pages


def test_a_replayed_token_the_grammar_refuses_fails_only_that_request():
    decode = _engine("decode")
    ids = decode.tokenize(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=50, structured_output=StructuredOutput(choice=["yes"]))
    decode.add_remote_request("bad", ids, params)
    decode.add_request("ok", PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
    decode.step()
    assert decode.complete_remote_prefill("bad", decode.tokenize("{")[-1])
    done = _run(decode)
    assert done["bad"].finish_reason == "error" and "structured output" in done["bad"].error
    assert done["ok"].finish_reason == "length"
    assert decode.num_free_pages() == decode.allocator.num_pages


def test_retraction_keeps_the_matcher_and_accepts_no_token_twice(caplog):
    # 8 prompts of 19-42 tokens + up to ~90 JSON tokens overcommit a pool of 20 pages of 16 tokens.
    params = [_sampled(seed) for seed in range(8)]
    reference = [o.outputs[0].text for o in LLM().generate(PROMPTS, params)]
    tiny = LLM(page_size=16, num_pages=20, schedule_conservativeness=0.1)
    outs = tiny.generate(PROMPTS, [_sampled(seed) for seed in range(8)])
    assert tiny.engine.scheduler.num_retracted_total > 0
    assert [o.outputs[0].text for o in outs] == reference
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert tiny.engine.num_free_pages() == 20


def test_a_spec_the_engine_cannot_compile_is_rejected_naming_the_field(llm, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("unsupported")
    spec = StructuredOutput(regex="[0-9]+ apples", param="guided_regex")
    monkeypatch.setattr(llm.engine.grammars, "_cache", {})
    monkeypatch.setattr(llm.engine.grammars._get_compiler(), "compile_regex", broken, raising=False)
    with pytest.raises(RequestRejected) as e:
        llm.engine.add_request("x", PROMPT, SamplingParams(structured_output=spec))
    assert e.value.param == "guided_regex"
    assert "x" not in llm.engine.requests


def test_a_broken_matcher_fails_only_its_request():
    engine = _engine("mixed")
    greedy = SamplingParams(temperature=0.0, max_tokens=200, structured_output=JSON_SPEC)
    for rid in ("broken", "ok"):
        engine.add_request(rid, PROMPT, greedy)
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))

    def fill(bitmask, row):
        raise RuntimeError("matcher state lost")
    engine.requests["broken"].grammar.fill = fill
    done = _run(engine)
    assert done["broken"].finish_reason == "error" and "matcher state lost" in done["broken"].error
    assert done["ok"].finish_reason == "stop"
    jsonschema.validate(json.loads(done["ok"].new_text), SCHEMA)
    assert done["free"].finish_reason == "length"
    assert engine.num_free_pages() == engine.allocator.num_pages


def test_streamed_deltas_add_up_to_the_same_valid_json():
    engine = _engine("mixed")
    params = [_sampled(seed) for seed in range(4)]
    reference = [o.outputs[0].text for o in LLM().generate([PROMPT] * 4, params)]
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", PROMPT, _sampled(i), stream=True)
    text = {f"s{i}": "" for i in range(4)}
    for _ in range(400):
        for d in engine.step().deltas:
            text[d.request_id] += d.new_text
        if not engine.has_work():
            break
    assert [text[f"s{i}"] for i in range(4)] == reference
    for t in reference:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_logit_bias_and_penalties_cannot_lift_a_masked_token(llm):
    tok = llm.get_tokenizer()
    spec = StructuredOutput(choice=["yes", "no"])
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    bias = {free: 100.0, tok.eos_token_id: 100.0}
    outs = llm.generate([PROMPT] * 6, [SamplingParams(temperature=t, seed=s, max_tokens=10, structured_output=spec,
                                                      logit_bias=bias, repetition_penalty=1.8, presence_penalty=-2.0)
                                       for t, s in [(0.0, None), (1.0, 1), (1.0, 2), (2.0, 3), (2.0, 4), (2.0, 5)]])
    assert all(o.outputs[0].text in ("yes", "no") for o in outs), [o.outputs[0].text for o in outs]
