"""Sampling parameters: validation errors name the field; sampling modes behave as specified."""

from __future__ import annotations

import pytest

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.sampling.params import SamplingParamError


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(stop=42), "stop"),
    (dict(stop={"a": 1}), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_parameters_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, SamplingParamError) and err.value.param == field
    assert str(err.value).startswith(field)


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("Once upon a time", p)[0].token_ids
    batch = llm.generate(["The dog", "Once upon a time", "A big tree"],
                         [SamplingParams(max_tokens=24, temperature=1.0), p, SamplingParams(max_tokens=5)])
    assert batch[1].token_ids == alone
    other_seed = llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9,
                                                                 seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate("Lily saw a", SamplingParams(max_tokens=20, temperature=0.0))[0].token_ids
    topk1 = llm.generate("Lily saw a", SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=3))[0].token_ids
    assert topk1 == greedy


def test_min_p_near_one_is_greedy(llm):
    greedy = llm.generate("Tom had a", SamplingParams(max_tokens=20, temperature=0.0))[0].token_ids
    minp = llm.generate("Tom had a", SamplingParams(max_tokens=20, temperature=1.0, min_p=0.999, seed=5))[0].token_ids
    assert minp == greedy


def test_high_temperature_differs_from_greedy(llm):
    greedy = llm.generate("Tom had a", SamplingParams(max_tokens=30, temperature=0.0))[0].token_ids
    hot = llm.generate("Tom had a", SamplingParams(max_tokens=30, temperature=2.0, seed=7))[0].token_ids
    assert hot != greedy


def test_stop_strings_cut_the_text_and_stop_ids_end_generation(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=64, temperature=0.0, stop=["park", "Lily"]))[0]
    assert out.text == ", there was a little girl named " and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == "Lily"
    kept = llm.generate("Once upon a time", SamplingParams(max_tokens=64, temperature=0.0, stop="Lily",
                                                            include_stop_str_in_output=True))[0]
    assert kept.text == ", there was a little girl named Lily"
    by_id = llm.generate("Once upon a time", SamplingParams(max_tokens=64, temperature=0.0, stop_token_ids=[298]))[0]
    assert by_id.token_ids[-1] == 298 and by_id.finish_reason == "stop" and by_id.outputs[0].stop_reason == 298
    assert len(by_id.token_ids) == 6


def test_max_tokens_and_eos(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_logprobs(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                                                          prompt_logprobs=2))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for tok, (lp, top) in zip(out.token_ids, lps):
        assert len(top) == 3 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy: chosen is the top-1
        assert top[0][1] >= top[1][1] >= top[2][1]
    assert len(out.prompt_logprobs) == 4  # one per prompt token after the first


def _hf_greedy_with_min_tokens(prompt: str, max_new: int, min_new: int, stop_ids: list[int]) -> list[int]:
    """transformers' greedy run that bans `stop_ids` for the first `min_new` tokens and stops on them after."""
    import torch
    from engine_reference import hf_model
    model, tok = hf_model()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, min_new_tokens=min_new,
                             eos_token_id=stop_ids, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_min_tokens_bans_stop_ids_until_reached_like_transformers(llm):
    # The reported request: it used to kill the engine loop (in-place write to an inference tensor).
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0))[0]
    assert out.token_ids == [432, 383, 286, 261] and out.finish_reason == "length"
    # Greedy stops on id 426 (".") after 11 tokens; min_tokens=12 bans it (and EOS) until 12 tokens exist.
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[426]))[0]
    assert len(free.token_ids) == 11 and free.token_ids[-1] == 426
    eos = list(llm.engine.eos_token_ids)
    held = llm.generate("Once upon a time", SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[426],
                                                           min_tokens=12))[0]
    assert held.token_ids == _hf_greedy_with_min_tokens("Once upon a time", 60, 12, [426] + eos)
    assert held.token_ids[:10] == free.token_ids[:10] and 426 not in held.token_ids[:12]
    assert len(held.token_ids) == 23 and held.token_ids[-1] == 426 and held.finish_reason == "stop"
    assert held.text == ", there was a little girl named Lily who loved to play with her toys."
