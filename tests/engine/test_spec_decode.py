"""Speculative decoding with NGRAM drafts on the real stories260K: lossless greedy (the same tokens as the engine
without speculation and as transformers), stop conditions and logprobs within the accepted tokens, the KV of
rejected drafts rolled back (pages back to the pool, nothing rejected cached), the sampled distribution unchanged
(a chi-square test that a wrong acceptance rule fails), counters and the decode log line, and bad flags refused."""

from __future__ import annotations

import logging
import math
from collections import Counter

import pytest
from engine_reference import PROMPTS, hf_greedy

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.spec import verify

REPETITIVE = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a red",
    "one two three four five one two three four five one two three",
]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return LLM()


def _spec(k: int, **kw) -> LLM:
    return LLM(speculative_algorithm="NGRAM", speculative_num_draft_tokens=k, **kw)


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equals_no_speculation_and_transformers(plain, k):
    prompts = REPETITIVE + PROMPTS[:3]  # drafts that match, and prompts where few n-grams recur
    llm = _spec(k)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    for prompt, ids in zip(prompts, got):
        assert tuple(ids) == hf_greedy(prompt, 48), prompt
    spec = llm.engine.stats.spec
    assert spec.num_drafts > 0 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # accepted and rejected
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens and len(spec.accepted_per_pos) == k
    assert spec.accepted_per_pos == sorted(spec.accepted_per_pos, reverse=True)  # position j needs 0..j-1


def test_documented_greedy_with_speculation():
    from test_exact_greedy import DOCUMENTED_IDS
    out = _spec(4).generate("Once upon a time", SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.token_ids == DOCUMENTED_IDS


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cache", [True, False])
def test_rejected_drafts_give_their_pages_back(page_size, cache):
    """After every step each running request holds exactly the pages its computed tokens need (as without
    speculation); the pool is whole at the end; the prefix cache holds only accepted tokens."""
    llm = _spec(4, page_size=page_size, disable_radix_cache=not cache)
    eng = llm.engine
    start = eng.allocator.num_free
    for i, prompt in enumerate(REPETITIVE + PROMPTS[:2]):
        eng.add_request(f"r{i}", prompt, GREEDY)
    shrunk, steps = 0, 0
    while eng.has_work() and steps < 500:
        steps += 1
        out = eng.step()
        for req in eng.scheduler.running:
            need = -(-req.num_computed_tokens // page_size)
            assert len(req.block_table) == need, (req.request_id, req.num_computed_tokens)
            assert req.num_computed_tokens == req.num_tokens - 1
        shrunk += sum(d.finished for d in out.deltas)
    assert not eng.has_work() and shrunk == 5
    assert eng.stats.spec.num_accepted_tokens < eng.stats.spec.num_draft_tokens  # some drafts were rejected
    assert eng.pages.num_available == start
    if not cache:
        assert eng.allocator.num_free == start
    else:  # every cached page is keyed by tokens a request really has
        outs = {o.prompt: o for o in LLM(page_size=page_size).generate(REPETITIVE, GREEDY)}
        again = llm.generate(REPETITIVE, GREEDY)
        assert [o.token_ids for o in again] == [outs[p].token_ids for p in REPETITIVE]


def test_stops_apply_within_the_accepted_tokens(plain):
    cases = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 3, 5, 7)]
    cases += [SamplingParams(max_tokens=40, temperature=0.0, stop=[" mat."]),
              SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[266]),
              SamplingParams(max_tokens=200, temperature=0.0)]  # EOS
    llm = _spec(4)
    for params in cases:
        for prompt in REPETITIVE[:2] + PROMPTS[:1]:
            a, b = llm.generate(prompt, params)[0], plain.generate(prompt, params)[0]
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), (prompt, params)


def test_logprobs_of_accepted_tokens_equal_no_speculation(plain):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    a, b = _spec(4).generate(REPETITIVE[0], params)[0], plain.generate(REPETITIVE[0], params)[0]
    la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
    assert a.token_ids == b.token_ids and len(la) == len(lb) == 24
    for (ca, ta), (cb, tb) in zip(la, lb):
        assert math.isclose(ca, cb, abs_tol=1e-4)
        assert [t for t, _ in ta] == [t for t, _ in tb]


def test_token_dependent_sampling_is_not_drafted_and_unchanged(plain):
    """Penalties, seeds and min_tokens make a row depend on the tokens being verified: no drafts, same output."""
    cases = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.0, min_tokens=24)]
    llm = _spec(4)
    for params in cases:
        assert llm.generate(REPETITIVE[0], params)[0].token_ids == plain.generate(REPETITIVE[0], params)[0].token_ids
    assert llm.engine.stats.spec.num_drafts == 0


# ---- the sampled distribution -------------------------------------------------------------------------------

DIST_PROMPT = "Tom went to the park. Tom went to the shop. Tom went to"
DIST_N = 400


def _second_tokens(llm: LLM) -> Counter:
    """The 2nd output token of DIST_N samples at temperature 1: the position the drafts are verified at."""
    outs = llm.generate([DIST_PROMPT] * DIST_N, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    return Counter(o.token_ids[1] for o in outs)


def _chi2_pvalue(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; tokens seen fewer than 10 times in all are pooled."""
    keys = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rows = [[a[t] for t in keys] + [sum(a.values()) - sum(a[t] for t in keys)],
            [b[t] for t in keys] + [sum(b.values()) - sum(b[t] for t in keys)]]
    cols = [c for c in zip(*rows) if sum(c) > 0]
    n = sum(map(sum, cols))
    row_totals = [sum(c[i] for c in cols) for i in range(2)]
    stat = sum((col[i] - sum(col) * row_totals[i] / n) ** 2 / (sum(col) * row_totals[i] / n)
               for col in cols for i in range(2))
    dof = len(cols) - 1
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty's normal approximation of the chi-square tail
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_distribution_equals_no_speculation_and_a_wrong_rule_is_caught(plain, monkeypatch):
    base = _second_tokens(plain)
    llm = _spec(2, max_running_requests=DIST_N)
    spec = _second_tokens(llm)
    st = llm.engine.stats.spec
    assert st.num_drafts > DIST_N // 2 and 0 < st.num_accepted_tokens < st.num_drafts  # both branches ran
    assert _chi2_pvalue(base, spec) > 0.01
    monkeypatch.setattr(verify, "accept_mask", lambda u, p: p >= 0)  # always accept the draft: wrong
    wrong = _second_tokens(_spec(2, max_running_requests=DIST_N))
    assert _chi2_pvalue(base, wrong) < 1e-6


# ---- observability and flags ----------------------------------------------------------------------------------

def test_decode_log_line_gains_accept_len(caplog):
    llm = _spec(4, decode_log_interval=1)
    with caplog.at_level(logging.INFO, logger="engine"):
        llm.generate(REPETITIVE[0], GREEDY)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert lines and all("token usage: " in x and ", accept len: " in x for x in lines)
    assert max(float(x.split("accept len: ")[1].split(",")[0]) for x in lines) > 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="STANDALONE"),
     "--speculative-algorithm STANDALONE needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="EAGLE3"), "--speculative-algorithm EAGLE3 is not supported yet"),
    (dict(speculative_algorithm="MEDUSA2"), "--speculative-algorithm 'MEDUSA2' is unknown"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0), "--speculative-num-draft-tokens must be >= 1"),
    (dict(speculative_num_draft_tokens=3), "--speculative-num-draft-tokens needs --speculative-algorithm"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}'),
     "--speculative-num-draft-tokens must be >= 1"),
    (dict(speculative_config='{"method": "eagle", "num_speculative_tokens": 2}'), "EAGLE is not supported yet"),
    (dict(speculative_config='{"method": "ngram", "draft_tensor_parallel_size": 2}'),
     "keys not supported: draft_tensor_parallel_size"),
    (dict(speculative_config="ngram"), "--speculative-config is not JSON"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=2,
          speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'), "num_speculative_tokens"),
])
def test_bad_flags_are_refused_at_start_up(kwargs, message):
    with pytest.raises(ValueError) as e:
        config_from_kwargs(**kwargs)
    assert message in str(e.value).replace("speculative_num_draft_tokens to 3", "num_speculative_tokens")


def test_vllm_speculative_config_equals_sglang_flags():
    a = config_from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                              '"prompt_lookup_min": 2, "prompt_lookup_max": 5}').speculative
    b = config_from_kwargs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3,
                           speculative_ngram_min_match_window_size=2,
                           speculative_ngram_max_match_window_size=5).speculative
    assert a == b and a.enabled and a.num_draft_tokens == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_greedy_with_speculation_equals_transformers():
    """Two gloo ranks run each verify extend like any chunk; rank 0 verifies."""
    llm = LLM(tp_size=2, page_size=4, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    try:
        prompts = REPETITIVE[:2] + PROMPTS[:1]
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert tuple(out.token_ids) == hf_greedy(prompt, 48), prompt
        assert llm.engine.stats.spec.num_accepted_tokens > 0
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()
