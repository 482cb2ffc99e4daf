"""Sampling parameters: validation errors name the field; sampling modes behave as specified."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.errors import SamplingParamError


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


# ---- filters without a full sort, against transformers' warpers --------------------------------------------------

def _reference_filter(x, top_k: int, top_p: float, min_p: float):
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    ids = torch.zeros(1, 1, dtype=torch.long)
    row = x[None].clone()
    if top_k > 0:
        row = TopKLogitsWarper(top_k)(ids, row)
    if top_p < 1.0:
        row = TopPLogitsWarper(top_p)(ids, row)
    if min_p > 0.0:
        row = MinPLogitsWarper(min_p)(ids, row)
    return row[0]


FILTERS = [(-1, 0.9, 0.0), (50, 1.0, 0.0), (50, 0.8, 0.0), (0, 0.5, 0.05), (10, 0.95, 0.2), (-1, 1.0, 0.3),
           (3000, 0.99, 0.0), (1, 0.3, 0.0), (-1, 0.999, 0.0)]


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_top_k_top_p_min_p_equal_transformers_warpers(scale):
    from pd_cluster.engine.sampling.sampler import top_k_top_p_min_p
    g = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(len(FILTERS), 5000, generator=g) * scale
    ours = top_k_top_p_min_p(x, torch.tensor([f[0] for f in FILTERS]), torch.tensor([f[1] for f in FILTERS]),
                             torch.tensor([f[2] for f in FILTERS]), max_k=max(f[0] for f in FILTERS))
    for i, (k, p, m) in enumerate(FILTERS):
        ref = _reference_filter(x[i], k, p, m)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), (i, FILTERS[i])
        assert torch.equal(ours[i][~torch.isinf(ref)], x[i][~torch.isinf(ref)])
        assert torch.isfinite(ours[i]).sum() >= 1


class Ops(TorchDispatchMode):
    """Records the name of every aten operator run inside it."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_top_p_within_a_top_k_reads_nothing_back_from_the_device():
    """Every top-p row also has a top-k of at most 1,024: the candidates hold all the mass, so the host check
    that widens them (a device sync on CUDA: a tensor read into a Python bool) is skipped; same result."""
    from pd_cluster.engine.sampling.sampler import top_k_top_p_min_p

    filters = [(50, 0.8, 0.0), (10, 0.95, 0.2), (1, 0.3, 0.0), (1000, 0.99, 0.0), (-1, 1.0, 0.1)]
    x = torch.randn(len(filters), 32000, generator=torch.Generator().manual_seed(3)) * 0.5  # flat: 1,024 hold
    args = (x, torch.tensor([f[0] for f in filters]), torch.tensor([f[1] for f in filters]),  # little mass
            torch.tensor([f[2] for f in filters]))
    with Ops() as ops:
        ours = top_k_top_p_min_p(*args, max_k=1000, top_p_in_top_k=True)
    assert "_local_scalar_dense" not in ops.seen and "is_nonzero" not in ops.seen, sorted(ops.seen)
    for i, (k, p, m) in enumerate(filters):
        ref = _reference_filter(x[i], k, p, m)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), (i, filters[i])
    with Ops() as ops:  # without the promise the check runs (and is what this test must see disappear)
        assert torch.equal(top_k_top_p_min_p(*args, max_k=1000), ours)
    assert {"_local_scalar_dense", "is_nonzero"} & ops.seen


def test_no_full_sort_of_a_128k_vocabulary_for_greedy_top_k_top_p_min_p_and_logprobs():
    from pd_cluster.engine.sampling.batch import SamplingBatch
    from pd_cluster.engine.sampling.sampler import Sampler, prompt_logprobs

    vocab = 128256
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 4  # a peaked distribution
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(top_k=40, seed=1, logprobs=20),
              SamplingParams(top_p=0.9, seed=2), SamplingParams(min_p=0.1), SamplingParams(top_k=100, top_p=0.8)]
    sampler = Sampler(torch.device("cpu"), vocab_size=vocab)
    batch = SamplingBatch.plain(params, [sampler.new_request_generator(p.seed) for p in params])
    with Ops() as ops:
        out = sampler(x, batch)
        prompt_logprobs(x, [1, 2, 3, 4, 5], 20)
    assert out.errors == [None] * 5 and out.token_ids[0] == int(x[0].argmax())
    assert "topk" in ops.seen and not {"sort", "argsort", "msort"} & ops.seen, sorted(ops.seen)
    with Ops() as ops:
        sampler(x, SamplingBatch.plain([SamplingParams(temperature=0.0)] * 5))
    assert not {"sort", "argsort", "topk"} & ops.seen


# ---- seeded sampling and Sampler.skip --------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(seed=11), SamplingParams(seed=12, top_k=20, top_p=0.9),
                                    SamplingParams(seed=13, min_p=0.05, temperature=0.7),
                                    SamplingParams(seed=14, repetition_penalty=1.3, logit_bias={3: 5.0}),
                                    SamplingParams(seed=15, temperature=0.0)])
def test_skip_advances_the_generator_exactly_as_sampling_one_token(params):
    from pd_cluster.engine.sampling.batch import SamplingBatch
    from pd_cluster.engine.sampling.sampler import Sampler
    vocab = 512
    g = torch.Generator().manual_seed(7)
    first, second = torch.randn(2, 3, vocab, generator=g) * 3
    sampler = Sampler(torch.device("cpu"), vocab_size=vocab)
    others = [SamplingParams(seed=99), SamplingParams()]

    def batch(gen):  # the seeded request sits between an unseeded and another seeded one
        p = [others[1], params, others[0]]
        return SamplingBatch([*p], [None, gen, sampler.new_request_generator(99)], [[1, 2], [1, 2, 3], [4]],
                             [1, 2, 1], [(), (), ()])

    g_sampled = sampler.new_request_generator(params.seed)
    sampler(first, batch(g_sampled))
    want = sampler(second, batch(g_sampled)).token_ids[1]
    g_skipped = sampler.new_request_generator(params.seed)
    sampler.skip(params, g_skipped)
    got = sampler(second, batch(g_skipped)).token_ids[1]
    assert got == want and torch.equal(g_skipped.get_state(), g_sampled.get_state())
    untouched = sampler.new_request_generator(params.seed)
    assert torch.equal(g_skipped.get_state(), untouched.get_state()) == params.greedy


def test_seeded_sampling_draws_the_distribution():
    """Many seeds on one fixed distribution: frequencies match the top-k-renormalised probabilities."""
    from pd_cluster.engine.sampling.batch import SamplingBatch
    from pd_cluster.engine.sampling.sampler import Sampler
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    sampler = Sampler(torch.device("cpu"), vocab_size=6)
    counts = Counter()
    for seed in range(4000):
        p = SamplingParams(seed=seed, top_k=3)
        counts[sampler(logits, SamplingBatch.plain([p], [sampler.new_request_generator(seed)])).token_ids[0]] += 1
    expected = logits[0, :3].softmax(-1)
    assert set(counts) == {0, 1, 2}
    for tok in range(3):
        assert abs(counts[tok] / 4000 - expected[tok].item()) < 0.03


# ---- per-request fault isolation -------------------------------------------------------------------------------

def _run_engine(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals, steps = {}, 0
    while engine.has_work() and steps < 500:
        steps += 1
        for d in engine.step().deltas:
            if d.finished:
                finals[d.request_id] = d
    return finals


def test_a_failing_logits_processor_fails_only_its_request(llm):
    from engine_reference import PROMPTS, hf_greedy

    def boom(output_ids, logits):
        if len(output_ids) == 3:
            raise RuntimeError("boom")
        return logits

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    finals = _run_engine(engine, [("ok0", PROMPTS[0], greedy),
                                  ("bad", PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                                     logits_processors=[boom])),
                                  ("ok2", PROMPTS[2], greedy),
                                  ("nan", PROMPTS[3], SamplingParams(max_tokens=24, ignore_eos=True, logits_processors=[
                                      lambda out, row: torch.full_like(row, float("-inf"))]))])
    assert finals["bad"].finish_reason == "error" and "boom" in finals["bad"].error
    assert finals["bad"].new_token_ids == list(hf_greedy(PROMPTS[1], 24))[:3]
    assert finals["nan"].finish_reason == "error" and "no finite value" in finals["nan"].error
    for rid, prompt in (("ok0", PROMPTS[0]), ("ok2", PROMPTS[2])):
        assert finals[rid].finish_reason == "length" and finals[rid].error is None
        assert finals[rid].new_token_ids == list(hf_greedy(prompt, 24))
    assert engine.num_free_pages() == engine.allocator.num_pages and not engine.requests
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.0, logits_processors=[boom]))[0]
    assert out.finish_reason == "error" and len(out.token_ids) == 3


def test_a_row_that_breaks_the_batched_path_is_isolated_row_by_row(llm):
    from engine_reference import PROMPTS, hf_greedy
    engine = llm.engine
    biased = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={5: 1.0})
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("broken", PROMPTS[4], SamplingParams(max_tokens=12, temperature=0.0, logit_bias={5: 1.0}))
    engine.requests["broken"].params.logit_bias[10**6] = 1.0  # past admission's check: the batched index fails
    finals = _run_engine(engine, [("a", PROMPTS[5], greedy), ("b", PROMPTS[6], biased)])
    assert finals["broken"].finish_reason == "error" and "IndexError" in finals["broken"].error
    assert finals["a"].new_token_ids == list(hf_greedy(PROMPTS[5], 12))
    assert finals["b"].finish_reason == "length" and len(finals["b"].new_token_ids) == 12
    assert engine.num_free_pages() == engine.allocator.num_pages and not engine.requests


def test_stop_strings_wait_for_min_tokens_like_vllm(llm):
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=80, temperature=0.0, stop="Lily"))[0]
    assert free.text == ", there was a little girl named " and len(free.token_ids) == 10
    held = llm.generate("Once upon a time", SamplingParams(max_tokens=80, temperature=0.0, stop="Lily",
                                                           min_tokens=12))[0]
    assert held.finish_reason == "stop" and held.outputs[0].stop_reason == "Lily"
    assert held.text == (", there was a little girl named Lily. She loved to play outside in the park. One day, she "
                         "saw a big, red ball. She wanted to play with it, but it was too high.\n")


def test_a_row_that_breaks_the_batched_choice_fails_alone_and_seeded_rows_draw_once(monkeypatch):
    """A failure before any draw retries row by row: the seeded rows' tokens are those of a batch without it."""
    from pd_cluster.engine.sampling import sampler as sampler_mod
    from pd_cluster.engine.sampling.batch import SamplingBatch
    real = sampler_mod.top_k_top_p_min_p

    def fragile(x, top_k, top_p, min_p, **kw):
        if bool((top_p == 0.125).any()):
            raise RuntimeError("filter broke")
        return real(x, top_k, top_p, min_p, **kw)

    monkeypatch.setattr(sampler_mod, "top_k_top_p_min_p", fragile)
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(seed=1, top_k=30), SamplingParams(top_p=0.125, seed=2), SamplingParams(temperature=0.0),
              SamplingParams(seed=4, top_p=0.9)]
    sampler = sampler_mod.Sampler(torch.device("cpu"), vocab_size=vocab)

    def run(rows):
        ps = [params[i] for i in rows]
        gens = [sampler.new_request_generator(p.seed) for p in ps]
        return sampler(logits[rows], SamplingBatch.plain(ps, gens)), gens

    out, gens = run([0, 1, 2, 3])
    assert out.errors[1] is not None and "filter broke" in out.errors[1] and out.token_ids[1] == -1
    assert [e for i, e in enumerate(out.errors) if i != 1] == [None] * 3
    healthy, healthy_gens = run([0, 2, 3])
    assert [out.token_ids[i] for i in (0, 2, 3)] == healthy.token_ids and healthy.token_ids[1] == int(logits[2].argmax())
    assert torch.equal(gens[0].get_state(), healthy_gens[0].get_state())
    assert torch.equal(gens[3].get_state(), healthy_gens[2].get_state())


def test_prefill_role_min_tokens_and_a_failing_request_keep_pages_held_until_released():
    """The prefill worker samples the first token (EOS banned by min_tokens); a failing request hands over nothing."""
    engine = LLM(role="prefill").engine

    def boom(output_ids, logits):
        raise RuntimeError("boom")

    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0))
    engine.add_request("b", "Once upon a time", SamplingParams(max_tokens=4, temperature=0.0, logits_processors=[boom]))
    out = engine.step()
    deltas = {d.request_id: d for d in out.deltas}
    assert deltas["a"].new_token_ids == [432] and deltas["a"].error is None
    assert deltas["b"].finish_reason == "error" and deltas["b"].new_token_ids == [] and "boom" in deltas["b"].error
    assert [(p.request_id, p.done) for p in out.prefill_progress] == [("a", True)]
    assert sorted(engine.scheduler.held) == ["a", "b"] and engine.num_free_pages() < engine.allocator.num_pages
    assert engine.release_request("a") and engine.release_request("b")
    assert engine.num_free_pages() == engine.allocator.num_pages and not engine.has_work()
