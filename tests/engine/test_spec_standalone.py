"""STANDALONE speculative decoding (a draft model) on the real stories260K: lossless greedy with three drafts
(stories260K itself: every draft accepted; its first 4 layers and a tiny random Llama, both built by transformers'
``save_pretrained`` with stories260K's tokenizer: drafts accepted and rejected), the draft KV rolled back and
freed with the request (the draft pool whole at the end), the sampled distribution unchanged, and the start-up
errors that name the flag."""

from __future__ import annotations

import json
import shutil

import pytest
from draft_models import other_vocab_draft, shallow_stories_draft, small_llama_draft
from engine_reference import PROMPTS, hf_greedy
from test_spec_decode import REPETITIVE, _chi2_pvalue, _second_tokens

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.assets import DEFAULT_MODEL

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
FLAG = "--speculative-draft-model-path"


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {"target": DEFAULT_MODEL, "shallow": shallow_stories_draft(root / "shallow"),
            "random": small_llama_draft(root / "random")}


@pytest.fixture(scope="module")
def plain():
    return LLM()


def _spec(path: str, k: int = 4, **kw) -> LLM:
    return LLM(speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
               speculative_num_draft_tokens=k, **kw)


@pytest.mark.parametrize("draft", ["target", "shallow", "random"])
def test_greedy_equals_no_speculation_and_transformers(plain, drafts, draft):
    prompts = REPETITIVE[:2] + PROMPTS[:3]
    llm = _spec(drafts[draft])
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    for prompt, ids in zip(prompts, got):
        assert tuple(ids) == hf_greedy(prompt, 40), prompt
    spec = llm.engine.stats.spec
    assert spec.num_drafts > 0 and sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    if draft == "target":  # the draft is the target: every greedy draft is the target's own token
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    else:
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    drafter = llm.engine.drafter.model
    assert not drafter.seqs and drafter.model.allocator.num_free == drafter.model.num_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_draft_kv_is_rolled_back_and_freed_with_the_request(drafts, page_size):
    """After every step each running request's draft KV holds its own tokens then at most K - 1 drafts, on
    exactly the pages they need; an aborted request's and a finished one's draft pages go back at once."""
    llm = _spec(drafts["shallow"], k=4, page_size=page_size)
    eng = llm.engine
    proposer = eng.drafter.model
    alloc = proposer.model.allocator
    for i, prompt in enumerate(REPETITIVE + PROMPTS[:2]):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30 + 5 * i, temperature=0.0, ignore_eos=True))
    steps = 0
    while eng.has_work() and steps < 400:
        steps += 1
        eng.step()
        if steps == 6:
            eng.abort_request("r1")
        held = 0
        for rid, seq in proposer.seqs.items():
            req = eng.requests[rid]
            assert seq.tokens[:seq.synced] == req.token_ids[:seq.synced]
            assert seq.synced <= req.num_tokens and len(seq.tokens) <= seq.synced + 3
            assert len(seq.pages) == -(-len(seq.tokens) // page_size)
            held += len(seq.pages)
        assert set(proposer.seqs) <= {r.request_id for r in eng.scheduler.running}
        assert alloc.num_free == alloc.num_pages - held
    assert not eng.has_work() and not proposer.seqs and alloc.num_free == alloc.num_pages
    assert eng.stats.spec.num_accepted_tokens < eng.stats.spec.num_draft_tokens


def test_retraction_drops_the_draft_kv_and_the_output_is_unchanged(plain, drafts):
    """A pool of 20 pages of 8 tokens overcommitted by 8 requests: retracted requests give their draft pages back
    and draft again from their prompt when they return."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = _spec(drafts["shallow"], page_size=8, num_pages=20, schedule_conservativeness=0.1)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    eng = llm.engine
    assert eng.scheduler.num_retracted_total > 0 and eng.stats.spec.num_accepted_tokens > 0
    alloc = eng.drafter.model.model.allocator
    assert eng.num_free_pages() == 20 and alloc.num_free == alloc.num_pages and not eng.drafter.model.seqs


def test_stops_and_logprobs_within_the_accepted_tokens(plain, drafts):
    llm = _spec(drafts["target"])
    cases = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 3, 6)]
    cases += [SamplingParams(max_tokens=40, temperature=0.0, stop=[" mat."]),
              SamplingParams(max_tokens=200, temperature=0.0),  # EOS
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)]
    for params in cases:
        a, b = llm.generate(REPETITIVE[0], params)[0], plain.generate(REPETITIVE[0], params)[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), params
        if params.logprobs:
            assert [[t for t, _ in top] for _, top in a.outputs[0].logprobs] == \
                   [[t for t, _ in top] for _, top in b.outputs[0].logprobs]


def test_sampled_distribution_equals_no_speculation(plain, drafts):
    """Greedy drafts are point masses: the rejection rule keeps the target's distribution (chi-square)."""
    base = _second_tokens(plain)
    llm = _spec(drafts["shallow"], k=2, max_running_requests=400)
    got = _second_tokens(llm)
    st = llm.engine.stats.spec
    assert st.num_drafts > 200 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert _chi2_pvalue(base, got) > 0.01


# ---- start-up errors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="STANDALONE"), f"STANDALONE needs {FLAG}"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/nonexistent/draft"),
     f"{FLAG} '/nonexistent/draft' is not a checkpoint folder"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path=DEFAULT_MODEL),
     f"{FLAG} is only used with --speculative-algorithm STANDALONE"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=DEFAULT_MODEL,
          speculative_num_draft_tokens=0), "--speculative-num-draft-tokens must be >= 1"),
    (dict(speculative_config='{"method": "draft_model", "num_speculative_tokens": 2}'), f"STANDALONE needs {FLAG}"),
])
def test_bad_draft_flags_are_refused(kwargs, message):
    with pytest.raises(ValueError) as e:
        config_from_kwargs(**kwargs)
    assert message in str(e.value)


def test_vllm_draft_model_config_equals_sglang_flags():
    a = config_from_kwargs(speculative_config=json.dumps({"method": "draft_model", "model": DEFAULT_MODEL,
                                                          "num_speculative_tokens": 3})).speculative
    b = config_from_kwargs(speculative_algorithm="STANDALONE", speculative_draft_model_path=DEFAULT_MODEL,
                           speculative_num_draft_tokens=3).speculative
    assert a == b and a.num_draft_tokens == 3


def test_draft_with_another_vocabulary_fails_at_start_up(tmp_path):
    with pytest.raises(ValueError) as e:
        _spec(other_vocab_draft(tmp_path / "v600"))
    assert f"{FLAG} " in str(e.value) and "600 tokens, the target's 512" in str(e.value)


def test_draft_with_another_tokenizer_fails_at_start_up(tmp_path, drafts):
    """Same vocabulary size, two tokens' ids swapped: another tokenizer."""
    folder = tmp_path / "swapped"
    shutil.copytree(drafts["random"], folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError) as e:
        _spec(str(folder))
    assert f"{FLAG} " in str(e.value) and "tokenizer is not the target's" in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "STANDALONE"], f"STANDALONE needs {FLAG}"),
    (["--speculative-algorithm", "STANDALONE", FLAG, "/nonexistent/draft"], "is not a checkpoint folder"),
    (["--speculative-algorithm", "STANDALONE", FLAG, DEFAULT_MODEL, "--speculative-num-draft-tokens", "0"],
     "--speculative-num-draft-tokens must be >= 1, got 0"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm 'MEDUSA' is unknown"),
])
def test_pd_worker_refuses_bad_speculative_flags_naming_them(argv, message, capsys):
    from pd_cluster.launch.worker import main

    with pytest.raises(SystemExit) as e:
        main(["--role", "decode", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_target_with_a_draft_model_equals_transformers(drafts):
    """Two gloo ranks run the target's verify extends; the draft model runs whole on rank 0."""
    llm = _spec(drafts["shallow"], tp_size=2, page_size=4)
    try:
        prompts = REPETITIVE[:1] + PROMPTS[:1]
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert tuple(out.token_ids) == hf_greedy(prompt, 40), prompt
        spec = llm.engine.stats.spec
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
        assert llm.engine.load()["draft_num_free_pages"] == llm.engine.load()["draft_num_total_pages"]
    finally:
        llm.engine.close()
