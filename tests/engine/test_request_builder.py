"""A request is built from the engine's frozen `RequestLimits` (no engine needed), and its output side is the
`OutputProcessor`'s: streamed deltas add up to the text made at the end, stop strings end it, resumed text is not
delivered twice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.errors import ContextLengthExceeded, EngineOverloaded, PoolCapacityExceeded, RequestRejected
from pd_cluster.engine.output_processor import OutputProcessor
from pd_cluster.engine.request import RequestStatus
from pd_cluster.engine.request_builder import RequestLimits, make_request
from pd_cluster.engine.sampling.grammar import GrammarManager
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.sampling.sampler import Sampler

LIMITS = RequestLimits(vocab_size=512, context_length=256, page_size=16, num_pages=32, max_queued_requests=4,
                       eos_token_ids=(2,), role="mixed")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def parts(tok):
    return Sampler(torch.device("cpu"), 0, LIMITS.vocab_size), GrammarManager(tok, LIMITS.vocab_size, (2,))


def _make(parts, limits=LIMITS, prompt=(5, 6, 7), params=None, resumed=(), num_waiting=0):
    sampler, grammars = parts
    return make_request(limits, "r", list(prompt), params or SamplingParams(), remote_kv=False,
                        resumed=list(resumed), num_waiting=num_waiting, sampler=sampler, grammars=grammars)


def test_limits_resolve_max_tokens_by_role(parts):
    assert _make(parts, params=SamplingParams(max_tokens=None)).max_tokens == LIMITS.context_length - 3
    prefill = dataclasses.replace(LIMITS, role="prefill")
    req = _make(parts, prefill, params=SamplingParams(max_tokens=50, min_tokens=9), resumed=[8, 9])
    assert (req.max_tokens, req.params.min_tokens, req.num_output_tokens) == (3, 3, 2)


def test_each_limit_refuses_by_name(parts):
    with pytest.raises(RequestRejected, match=r"\[0, 512\)"):
        _make(parts, prompt=[5, 512])
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 256 tokens"):
        _make(parts, params=SamplingParams(max_tokens=254))
    with pytest.raises(PoolCapacityExceeded, match="holds 128 tokens \\(8 pages of 16\\)"):
        _make(parts, dataclasses.replace(LIMITS, num_pages=8), params=SamplingParams(max_tokens=150))
    with pytest.raises(EngineOverloaded):
        _make(parts, num_waiting=LIMITS.max_queued_requests)
    with pytest.raises(RequestRejected, match="already ended the output") as e:
        _make(parts, resumed=[9, 2])  # EOS among the resumed tokens
    assert e.value.param == "resume_token_ids"


def test_resumed_tokens_advance_the_seeded_generator(parts):
    sampler, _ = parts
    params = SamplingParams(seed=7, temperature=1.0)
    req = _make(parts, params=params, resumed=[9, 10, 11])
    fresh = sampler.new_request_generator(7)
    for _ in range(3):
        sampler.skip(params, fresh)
    assert torch.equal(req.generator.get_state(), fresh.get_state())


PROMPT = "Once upon a time"


def _continuation(tok, text: str) -> list[int]:
    """The token ids that follow the prompt's in the tokenization of prompt + `text`."""
    prompt, ids = tok(PROMPT).input_ids, tok(PROMPT + text).input_ids
    assert ids[:len(prompt)] == prompt
    return ids[len(prompt):]


def _run(tok, parts, stream, stop=None, resumed_text="", text=", there was a little dog named Max. He"):
    """Feed the tokens of `text` through an `OutputProcessor` as the engine does; the deltas and why it ended."""
    resumed = _continuation(tok, resumed_text) if resumed_text else []
    out_ids = _continuation(tok, resumed_text + text)[len(resumed):]
    req = _make(parts, prompt=tok(PROMPT).input_ids, resumed=resumed,
                params=SamplingParams(max_tokens=len(resumed) + len(out_ids), stop=stop))
    outputs = OutputProcessor(tok, "mixed")
    outputs.add_request(req, stream)
    status = None
    for t in out_ids:
        req.append_token(t)
        status = req.check_stop()
        matched = outputs.match_stop_string(req, t)
        if matched is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, matched
        if status is not None:
            outputs.finish(req, status)
            break
        outputs.token(req, t, None)
    return outputs.take_deltas(), status


def test_streamed_deltas_add_up_to_the_text_made_at_the_end(tok, parts):
    streamed, status = _run(tok, parts, stream=True)
    whole, _ = _run(tok, parts, stream=False)
    assert status == RequestStatus.FINISHED_LENGTH and len(whole) == 1 and whole[0].finished
    assert "".join(d.new_text for d in streamed) == whole[0].new_text == ", there was a little dog named Max. He"
    assert [t for d in streamed for t in d.new_token_ids] == whole[0].new_token_ids


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_ends_the_request_and_is_never_sent(tok, parts, stream):
    deltas, status = _run(tok, parts, stream, stop=["dog"])
    assert status == RequestStatus.FINISHED_STOPPED and deltas[-1].stop_reason == "dog"
    assert "".join(d.new_text for d in deltas) == ", there was a little "


def test_resumed_output_is_not_delivered_again(tok, parts):
    deltas, _ = _run(tok, parts, stream=True, resumed_text=", there was", text=" a little dog")
    assert "".join(d.new_text for d in deltas) == " a little dog"
