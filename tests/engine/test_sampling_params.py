"""`SamplingParams` validation: every field is checked for type, finiteness, range and size, naming the field."""

from __future__ import annotations

import math

import pytest

from pd_cluster.engine.errors import SamplingParamError
from pd_cluster.engine.sampling.params import (MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                              MAX_STOP_TOKEN_IDS, SamplingParams)

NAN, INF = float("nan"), float("inf")

BAD = [
    # numbers that are not finite (issue: temperature NaN/Infinity passed)
    (dict(temperature=NAN), "temperature"), (dict(temperature=INF), "temperature"),
    (dict(temperature=-INF), "temperature"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(temperature=True), "temperature"),
    (dict(temperature=10**400), "temperature"),
    (dict(top_p=NAN), "top_p"), (dict(top_p=INF), "top_p"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_p="0.5"), "top_p"),
    (dict(min_p=NAN), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_k=2**40), "top_k"), (dict(top_k=None), "top_k"),
    (dict(presence_penalty=NAN), "presence_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"), (dict(presence_penalty="0"), "presence_penalty"),
    (dict(frequency_penalty=INF), "frequency_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=NAN), "repetition_penalty"), (dict(repetition_penalty=INF), "repetition_penalty"),
    # ints
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=2**31), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=3, max_tokens=2), "min_tokens"),
    (dict(min_tokens=1.0), "min_tokens"),
    (dict(n=0), "n"), (dict(n=129), "n"), (dict(n=2.0), "n"), (dict(n=None), "n"),
    (dict(seed="x"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=True), "seed"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=1.0), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    # stop strings and ids: types and sizes
    (dict(stop=42), "stop"), (dict(stop={"a": 1}), "stop"), (dict(stop=["ok", 3]), "stop"), (dict(stop=[""]), "stop"),
    (dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop"),
    (dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    # logit_bias: keys, values, size
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={"abc": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"-1": 1.0}), "logit_bias"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={1: NAN}), "logit_bias"),
    (dict(logit_bias={1: "2"}), "logit_bias"), (dict(logit_bias={1.5: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    # booleans and callables
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(include_stop_str_in_output=None), "include_stop_str_in_output"),
    (dict(logits_processors=[42]), "logits_processors"), (dict(logits_processors=lambda a, b: b), "logits_processors"),
    (dict(logits_processors=[lambda a: a]), "logits_processors"),
]


@pytest.mark.parametrize("kwargs, field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field and str(err.value).startswith(f"{field}: ")
    assert isinstance(err.value, ValueError)


GOOD = [
    dict(temperature=0.0), dict(temperature=5), dict(top_p=1), dict(top_p=1e-9), dict(top_k=0), dict(top_k=-1),
    dict(min_p=1.0), dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(repetition_penalty=1e-3),
    dict(n=128), dict(seed=-(2**63)), dict(seed=2**64 - 1), dict(max_tokens=None, min_tokens=100),
    dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]), dict(stop="x" * MAX_STOP_STRING_CHARS),
    dict(logit_bias={i: -100 for i in range(MAX_LOGIT_BIAS)}), dict(logit_bias={}), dict(logprobs=0),
    dict(logits_processors=[lambda out, row: row, lambda prompt, out, row: row]),
]


@pytest.mark.parametrize("kwargs", GOOD)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalised_forms():
    p = SamplingParams(stop="end", logit_bias={"7": 1, 7: 0.5, "12": -3.25}, stop_token_ids=(3, 4))
    assert p.stop == ["end"] and p.stop_token_ids == [3, 4]
    assert p.logit_bias == {7: 1.5, 12: -3.25} and all(isinstance(v, float) for v in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties


def test_vocabulary_check_names_logit_bias():
    SamplingParams(logit_bias={511: 1.0}).check_vocab(512)
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(logit_bias={512: 1.0}).check_vocab(512)
    assert err.value.param == "logit_bias"


def test_a_json_round_trip_keeps_the_params():
    """The decode worker sends the params to the prefill worker as JSON (`dataclasses.asdict`)."""
    import dataclasses
    import json
    p = SamplingParams(temperature=0.7, seed=5, logit_bias={3: 2.0}, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=-0.5, stop=["x"], min_tokens=2)
    q = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p))))
    assert q == p and not math.isnan(q.temperature)
