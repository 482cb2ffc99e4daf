"""Penalties and logit_bias: the batched implementation against references on the same logits, and end to end.

References: transformers' RepetitionPenaltyLogitsProcessor and SequenceBiasLogitsProcessor; for presence and
frequency penalties (which transformers lacks), OpenAI's formula written out token by token.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.sampling.batch import SamplingBatch
from pd_cluster.engine.sampling.penalties import apply_logit_bias, apply_penalties
from pd_cluster.engine.sampling.sampler import Sampler

VOCAB = 600


def _batch(rows: list[tuple[list[int], list[int], SamplingParams]]) -> SamplingBatch:
    return SamplingBatch([p for _, _, p in rows], [None] * len(rows), [pr + out for pr, out, _ in rows],
                         [len(pr) for pr, _, _ in rows], [() for _ in rows])


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    histories = []
    for n_prompt, n_out in ((7, 0), (12, 30), (3, 60), (20, 5), (9, 17)):
        prompt = torch.randint(0, VOCAB, (n_prompt,), generator=g).tolist()
        out = torch.randint(0, 40, (n_out,), generator=g).tolist()  # a small range: tokens repeat
        histories.append((prompt, out))
    logits = torch.randn(len(histories), VOCAB, generator=g) * 4
    return histories, logits


def _reference_presence_frequency(logits: torch.Tensor, out: list[int], presence: float, frequency: float):
    ref = logits.clone()
    for tok, count in Counter(out).items():
        ref[tok] -= count * frequency + presence
    return ref


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    histories, logits = _rows(1)
    params = [SamplingParams(repetition_penalty=penalty if i != 2 else 1.0) for i in range(len(histories))]
    ours = logits.clone()
    apply_penalties(ours, _batch([(pr, out, p) for (pr, out), p in zip(histories, params)]))
    for i, ((prompt, out), p) in enumerate(zip(histories, params)):
        proc = RepetitionPenaltyLogitsProcessor(p.repetition_penalty) if p.repetition_penalty != 1.0 else None
        ref = proc(torch.tensor([prompt + out]), logits[i:i + 1].clone())[0] if proc else logits[i]
        assert torch.equal(ours[i], ref), i
    assert not torch.equal(ours[0], logits[0])  # the prompt alone counts (no output yet)
    assert torch.equal(ours[2], logits[2])


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.8), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_equal_openai_formula(presence, frequency):
    histories, logits = _rows(2)
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency) for _ in histories]
    params[3] = SamplingParams()  # a row without penalties is untouched
    ours = logits.clone()
    apply_penalties(ours, _batch([(pr, out, p) for (pr, out), p in zip(histories, params)]))
    for i, ((prompt, out), p) in enumerate(zip(histories, params)):
        ref = _reference_presence_frequency(logits[i], out, p.presence_penalty, p.frequency_penalty)
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=1e-5)
    assert torch.equal(ours[0], logits[0])  # only generated tokens count: row 0 has none
    assert not torch.equal(ours[1], logits[1])


def test_all_penalties_together_follow_vllm_order():
    histories, logits = _rows(3)
    p = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.6)
    ours = logits.clone()
    apply_penalties(ours, _batch([(pr, out, p) for pr, out in histories]))
    for i, (prompt, out) in enumerate(histories):
        ref = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompt + out]), logits[i:i + 1].clone())[0]
        ref = _reference_presence_frequency(ref, out, 0.3, 0.6)
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=1e-5)


def test_logit_bias_equals_transformers_sequence_bias():
    histories, logits = _rows(4)
    biases = [{5: 3.5, 17: -100.0, 599: 42.0}, None, {"0": -1.25, "12": 100}, {40: 0.5}, None]
    params = [SamplingParams(logit_bias=b) for b in biases]
    ours = logits.clone()
    apply_logit_bias(ours, _batch([(pr, out, p) for (pr, out), p in zip(histories, params)]))
    for i, ((prompt, out), p) in enumerate(zip(histories, params)):
        if p.logit_bias is None:
            assert torch.equal(ours[i], logits[i])
            continue
        proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])
        ref = proc(torch.tensor([prompt + out]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=1e-5)
    assert params[2].logit_bias == {0: -1.25, 12: 100.0}  # OpenAI's JSON keys are strings


def test_sampler_applies_bias_and_penalties_before_greedy_choice():
    histories, logits = _rows(5)
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias={top[0]: -100}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={7: 100}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0)]
    out = Sampler(torch.device("cpu"), vocab_size=VOCAB)(logits, _batch(
        [(pr, o, p) for (pr, o), p in zip(histories, params)]))
    second = logits[0].topk(2).indices[1].item()
    assert out.token_ids[:3] == [second, top[1], 7] and out.errors == [None] * 5


# ---- end to end on the real model: greedy with a penalty equals transformers' generate with the same one

@pytest.fixture(scope="module")
def llm():
    return LLM()


def _hf_generate(prompt: str, max_new: int, **kwargs) -> list[int]:
    from engine_reference import hf_model
    model, tok = hf_model()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_with_repetition_penalty_equals_transformers_generate(llm):
    prompt = "Once upon a time"
    plain = llm.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0].token_ids
    outs = llm.generate([prompt, "Lily and Tom went to the park"],
                        [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, repetition_penalty=1.4),
                         SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, repetition_penalty=1.4)])
    assert outs[0].token_ids == _hf_generate(prompt, 48, repetition_penalty=1.4)
    assert outs[1].token_ids == _hf_generate("Lily and Tom went to the park", 48, repetition_penalty=1.4)
    assert outs[0].token_ids != plain


def test_greedy_with_logit_bias_equals_transformers_sequence_bias(llm):
    prompt = "Once upon a time"
    bias = {298: -100.0, 376: -5.0, 403: 2.0}
    ours = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                               logit_bias={str(k): v for k, v in bias.items()}))[0].token_ids
    assert ours == _hf_generate(prompt, 32, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert 298 not in ours


def test_presence_penalty_end_to_end_matches_token_by_token_reference(llm):
    """Greedy with presence/frequency penalties equals a loop that applies OpenAI's formula to the HF logits."""
    from engine_reference import hf_model
    model, tok = hf_model()
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=1.5)
    ours = llm.generate(prompt, params)[0].token_ids
    ids = tok(prompt).input_ids
    out: list[int] = []
    with torch.no_grad():
        for _ in range(32):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            out.append(int(_reference_presence_frequency(logits, out, 2.0, 1.5).argmax()))
    assert ours == out
    assert ours != llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids


def test_logit_bias_outside_the_vocabulary_is_rejected_naming_the_field(llm):
    from pd_cluster.engine.errors import RequestRejected
    with pytest.raises(RequestRejected) as err:
        llm.generate("Once", SamplingParams(max_tokens=2, logit_bias={100000: 1.0}))
    assert err.value.param == "logit_bias"
    assert not llm.engine.has_work() and llm.engine.num_free_pages() == llm.engine.allocator.num_pages


def test_n_above_one_is_refused_by_the_engine_and_fanned_out_by_llm_generate(llm):
    from pd_cluster.engine.errors import RequestRejected
    with pytest.raises(RequestRejected) as err:
        llm.engine.add_request("n2", "Once", SamplingParams(max_tokens=2, n=2))
    assert err.value.param == "n" and not llm.engine.requests
    # vLLM's LLM: one RequestOutput per prompt with n sequences; seeded, sequence i samples with seed + i
    outs = llm.generate(["Once", "Sam had"], SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=5))
    assert len(outs) == 2 and [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert outs[0].prompt == "Once" and outs[1].prompt == "Sam had"
    for out, prompt in zip(outs, ["Once", "Sam had"]):
        singles = [llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i))[0].text
                   for i in range(3)]
        assert [o.text for o in out.outputs] == singles and len(set(singles)) > 1
    assert not llm.engine.requests and llm.engine.num_free_pages() == llm.engine.allocator.num_pages
