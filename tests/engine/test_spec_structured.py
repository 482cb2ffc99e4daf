"""Structured outputs with speculative decoding (NGRAM, STANDALONE and NEXTN): structured-output requests are drafted,
each verified row is masked by the grammar as it stands after the drafts before it, so the output is the
same JSON as without speculation, token for token, and always valid; without the masks the same drafts break
the grammar (the check can fail). NEXTN runs on the tiny DeepSeek-V3 checkpoints with an MTP layer
(`mtp_models`), which carry stories260K's tokenizer (512 tokens), so the same schema compiles for them."""

from __future__ import annotations

import json

import jsonschema
import pytest
from deepseek_models import PROMPTS as DS_PROMPTS
from draft_models import shallow_stories_draft
from mtp_models import echo_mtp, random_mtp
from engine_reference import PROMPTS
from test_spec_decode import REPETITIVE
from test_structured_output import JSON_SPEC, SCHEMA

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.spec import verify

PROMPTS_JSON = PROMPTS[:3] + REPETITIVE[:1]
GREEDY_JSON = SamplingParams(max_tokens=200, temperature=0.0, structured_output=JSON_SPEC)


@pytest.fixture(scope="module")
def shallow(tmp_path_factory):
    return shallow_stories_draft(tmp_path_factory.mktemp("draft") / "shallow")


@pytest.fixture(scope="module")
def plain_json():
    return [(o.token_ids, o.text) for o in LLM().generate(PROMPTS_JSON, GREEDY_JSON)]


def _llm(method: str, shallow: str) -> LLM:
    if method == "ngram":
        return LLM(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    path = DEFAULT_MODEL if method == "standalone-target" else shallow
    return LLM(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, speculative_num_draft_tokens=4)


@pytest.mark.parametrize("method", ["ngram", "standalone-target", "standalone-shallow"])
def test_json_schema_greedy_equals_no_speculation_and_is_valid(plain_json, shallow, method):
    llm = _llm(method, shallow)
    got = llm.generate(PROMPTS_JSON, GREEDY_JSON)
    assert [(o.token_ids, o.text) for o in got] == plain_json
    for o in got:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    spec = llm.engine.stats.spec
    assert spec.num_drafts > 0 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_sampled_json_with_drafts_is_always_valid(shallow):
    llm = _llm("standalone-shallow", shallow)
    outs = llm.generate(PROMPTS_JSON * 5, SamplingParams(max_tokens=300, temperature=1.0, structured_output=JSON_SPEC))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert llm.engine.stats.spec.num_accepted_tokens > 0


def test_without_the_grammar_masks_the_drafts_break_the_grammar(monkeypatch):
    """The target drafting for itself proposes its unconstrained argmax: the masks are what reject it."""
    monkeypatch.setattr(verify, "grammar_masks", lambda x, reqs, drafts: None)
    outs = _llm("standalone-target", "").generate(PROMPTS_JSON, GREEDY_JSON)
    assert any(o.finish_reason == "error" for o in outs)


@pytest.fixture(scope="module", params=["echo", "random"])
def mtp_checkpoint(request, tmp_path_factory):
    """(kind, folder, the engine's greedy JSON without speculation) for a tiny DeepSeek-V3 with an MTP layer."""
    path = tmp_path_factory.mktemp(f"mtp-json-{request.param}")
    (echo_mtp if request.param == "echo" else random_mtp)(path)
    plain = LLM(str(path), kv_cache_dtype="fp32").generate(DS_PROMPTS[:3], GREEDY_JSON)
    return request.param, path, [(o.token_ids, o.text) for o in plain]


def _nextn(path) -> LLM:
    return LLM(str(path), kv_cache_dtype="fp32", speculative_algorithm="NEXTN", speculative_num_draft_tokens=3)


def test_nextn_json_schema_greedy_equals_no_speculation_and_sampled_is_valid(mtp_checkpoint):
    kind, path, plain = mtp_checkpoint
    llm = _nextn(path)
    got = llm.generate(DS_PROMPTS[:3], GREEDY_JSON)
    assert [(o.token_ids, o.text) for o in got] == plain
    sampled = llm.generate(DS_PROMPTS[:3] * 3, SamplingParams(max_tokens=300, temperature=1.0,
                                                               structured_output=JSON_SPEC))
    # strict=False: these random models pick byte tokens (<0x15>...) that xgrammar's JSON string rule admits raw,
    # with or without speculation, and Python's strict parser refuses control characters in strings
    for o in got:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text, strict=False), SCHEMA)
    for o in sampled:  # "stop": the grammar accepted every emitted token and reached its end
        assert o.finish_reason == "stop", o.text
        if kind == "echo":  # the random one's sampled strings split multi-byte characters (U+FFFD in maxLength)
            jsonschema.validate(json.loads(o.text, strict=False), SCHEMA)
    spec = llm.engine.stats.spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens < spec.num_draft_tokens
    if kind == "echo":  # its MTP layer predicts the target's unconstrained argmax: accepted where allowed
        assert spec.num_accepted_tokens > 0


def test_nextn_without_the_grammar_masks_the_drafts_break_the_grammar(tmp_path, monkeypatch):
    """The echo MTP layer drafts the target's unconstrained argmax: the masks are what reject it."""
    echo_mtp(tmp_path)
    monkeypatch.setattr(verify, "grammar_masks", lambda x, reqs, drafts: None)
    assert any(o.finish_reason == "error" for o in _nextn(tmp_path).generate(DS_PROMPTS[:3], GREEDY_JSON))
