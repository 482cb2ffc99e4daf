"""NEXTN speculative decoding (DeepSeek-V3's multi-token-prediction layer) on tiny DeepSeek-V3 checkpoints built
by transformers, with the MTP layer added in the release's tensor names (`mtp_models`): greedy tokens equal the
engine without speculation and transformers' greedy loop at K = 1 and 2, with a random MTP layer (drafts
rejected) and one that predicts the target's next token (drafts accepted); the MTP KV is rolled back and freed
with the request; a checkpoint without an MTP layer is refused naming the flag."""

from __future__ import annotations

import json

import pytest
from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids
from mtp_models import echo_mtp, random_mtp

from pd_cluster.engine import LLM, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FLAG = "--speculative-algorithm NEXTN"


@pytest.fixture(scope="module", params=["random", "echo"])
def checkpoint(request, tmp_path_factory):
    """(kind, folder, transformers' greedy tokens of PROMPTS[:3], the engine's without speculation)."""
    path = tmp_path_factory.mktemp(f"mtp-{request.param}")
    hf = (random_mtp if request.param == "random" else echo_mtp)(path)
    refs = [hf_greedy_recompute(hf, prompt_ids(p), MAX_NEW) for p in PROMPTS[:3]]
    plain = [o.token_ids for o in LLM(str(path), kv_cache_dtype="fp32").generate(PROMPTS[:3], GREEDY)]
    return request.param, path, refs, plain


def _nextn(path, k: int, **kw) -> LLM:
    """NEXTN with K = `k` drafts per step (SGLang's ``--speculative-num-draft-tokens`` counts the verified token)."""
    return LLM(str(path), kv_cache_dtype="fp32", speculative_algorithm="NEXTN", speculative_num_draft_tokens=k + 1,
               **kw)


def _pool_whole(llm: LLM) -> bool:
    proposer = llm.engine.drafter.model
    alloc = proposer.model.allocator
    return not proposer.seqs and alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_equals_no_speculation_and_transformers(checkpoint, k):
    kind, path, refs, plain = checkpoint
    assert plain == refs
    llm = _nextn(path, k)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == refs
    spec = llm.engine.stats.spec
    assert spec.num_drafts > 0 and sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    if kind == "random":  # random MTP weights: its drafts are (almost) never the target's tokens
        assert spec.num_accepted_tokens < spec.num_draft_tokens // 4
    else:  # the MTP layer computes the target's next token from its input token
        assert spec.num_accepted_tokens > spec.num_draft_tokens // 2
    assert llm.engine.drafter.model.num_no_hidden == 0  # every request drafted from its whole prompt
    assert _pool_whole(llm) and llm.engine.num_free_pages() == llm.engine.allocator.num_pages


def test_prefix_cache_hit_drafts_from_the_tokens_computed_here(checkpoint):
    """A prompt whose pages come from the prefix cache has no target hidden states for them: the MTP sequence
    starts at the first token computed, and the tokens are unchanged."""
    _, path, refs, _ = checkpoint
    llm = _nextn(path, 2, page_size=4)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == refs[0]
    seen = []
    proposer = llm.engine.drafter.model
    orig = proposer.on_hidden

    def spy(items, hidden):
        orig(items, hidden)
        seen.extend(s.base for s in proposer.seqs.values())

    llm.engine.runner.on_hidden = spy
    again = llm.generate(PROMPTS[0], GREEDY)[0]
    assert again.num_cached_tokens >= 4 and again.token_ids == refs[0]
    assert min(seen) == again.num_cached_tokens
    assert _pool_whole(llm)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mtp_kv_is_rolled_back_and_freed_with_the_request(checkpoint, page_size):
    """After every step each running request's MTP pages hold exactly its entries for known tokens plus the
    last chain's K - 1; an aborted request's pages go back at once and the pool is whole at the end."""
    _, path, _, _ = checkpoint
    k = 3
    llm = _nextn(path, k, page_size=page_size)
    eng = llm.engine
    proposer = eng.drafter.model
    alloc = proposer.model.allocator
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=10 + 4 * i, temperature=0.0, ignore_eos=True))
    steps = 0
    while eng.has_work() and steps < 200:
        steps += 1
        eng.step()
        if steps == 4:
            eng.abort_request("r1")
        held = 0
        for rid, seq in proposer.seqs.items():
            req = eng.requests[rid]
            assert seq.next_position <= req.num_tokens - 1
            assert len(seq.pages) <= -(-(req.num_tokens - 2 + k - seq.base) // page_size)
            held += len(seq.pages)
        assert set(proposer.seqs) <= {r.request_id for r in eng.scheduler.running}
        assert alloc.num_free == alloc.num_pages - held
    assert not eng.has_work() and _pool_whole(llm)
    assert eng.num_free_pages() == eng.allocator.num_pages


def test_checkpoint_without_mtp_layer_is_refused(tmp_path):
    """transformers writes ``num_nextn_predict_layers: 1`` but saves no MTP tensors; without the key at all the
    message names it."""
    build("deepseek-v3", tmp_path)
    with pytest.raises(ValueError) as e:
        _nextn(tmp_path, 2)
    assert FLAG in str(e.value) and "no model.layers.2.eh_proj.weight" in str(e.value)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("num_nextn_predict_layers", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        _nextn(tmp_path, 2)
    assert f"{FLAG}: {tmp_path} has no multi-token-prediction layer" in str(e.value)
    assert "num_nextn_predict_layers" in str(e.value)


def test_the_mtp_layer_reads_the_targets_final_norm_hidden_states(checkpoint):
    """After a prompt's prefill the MTP layer's pending hidden states are transformers' last hidden states (the
    final norm's output) at every prompt position."""
    import torch

    from mtp_models import reference_hidden

    _, path, _, _ = checkpoint
    llm = _nextn(path, 2, chunked_prefill_size=5)
    eng = llm.engine
    eng.add_request("h", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ids = prompt_ids(PROMPTS[1])
    while eng.requests["h"].num_tokens == len(ids):  # chunks of 5 until the first token is sampled
        eng.step()
    got = eng.drafter.model.seqs["h"].pending
    want = reference_hidden(path, ids)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_vllm_speculative_config_deepseek_mtp_is_nextn():
    from pd_cluster.engine.args import config_from_kwargs

    spec = config_from_kwargs(speculative_config='{"method": "deepseek_mtp", "num_speculative_tokens": 2}').speculative
    assert (spec.speculative_algorithm, spec.num_draft_tokens) == ("NEXTN", 2)


def test_sglang_chain_flags_set_k(checkpoint):
    """SGLang's MTP command line: ``--speculative-num-steps 2 --speculative-eagle-topk 1
    --speculative-num-draft-tokens 3`` drafts 2 tokens per step."""
    _, path, refs, _ = checkpoint
    llm = LLM(str(path), kv_cache_dtype="fp32", speculative_algorithm="NEXTN", speculative_num_steps=2,
              speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    assert llm.engine.drafter.k == 2 and len(llm.engine.stats.spec.accepted_per_pos) == 2
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == refs


def test_num_draft_tokens_counts_the_verified_token_as_in_sglang():
    """NEXTN's ``--speculative-num-draft-tokens N`` is SGLang's: tokens verified per step, the last known one
    included (N - 1 drafts), alone or with ``--speculative-num-steps N - 1``; no flag: SGLang's choice for
    DeepSeek-V3 (3 steps, 4 tokens); vLLM's ``num_speculative_tokens`` stays K itself."""
    from pd_cluster.engine.args import config_from_kwargs

    def k(**kw):
        return config_from_kwargs(speculative_algorithm="NEXTN", **kw).speculative.num_draft_tokens

    assert k(speculative_num_draft_tokens=3) == k(speculative_num_steps=2, speculative_num_draft_tokens=3) == 2
    assert k() == 3 and k(speculative_num_draft_tokens=2) == 1
    both = config_from_kwargs(speculative_num_draft_tokens=3,
                              speculative_config='{"method": "deepseek_mtp", "num_speculative_tokens": 2}')
    assert both.speculative.num_draft_tokens == 2
    ngram = config_from_kwargs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3).speculative
    assert ngram.num_draft_tokens == 3  # NGRAM and STANDALONE: K itself, as before


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="NEXTN", speculative_num_draft_tokens=1),
     "--speculative-num-draft-tokens 1 with --speculative-algorithm NEXTN drafts nothing"),
    (dict(speculative_algorithm="NEXTN", speculative_eagle_topk=4), "--speculative-eagle-topk 4 is not supported"),
    (dict(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_num_draft_tokens=2),
     "--speculative-num-draft-tokens 2 with --speculative-num-steps 2"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=2), "--speculative-num-steps is used with"),
    (dict(speculative_algorithm="NEXTN", speculative_num_steps=0), "--speculative-num-steps must be >= 1"),
])
def test_bad_chain_flags_are_refused(kwargs, message):
    from pd_cluster.engine.args import config_from_kwargs

    with pytest.raises(ValueError) as e:
        config_from_kwargs(**kwargs)
    assert message in str(e.value)


def test_a_request_never_drafted_keeps_no_hidden_states(checkpoint):
    """A penalised request decodes without drafts (as with every algorithm): the MTP drafter keeps nothing for
    it, and its tokens are the engine's without speculation."""
    _, path, _, _ = checkpoint
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    want = LLM(str(path), kv_cache_dtype="fp32").generate(PROMPTS[0], params)[0].token_ids
    llm = _nextn(path, 2)
    proposer = llm.engine.drafter.model
    orig, kept = proposer.on_hidden, []

    def spy(items, hidden):
        orig(items, hidden)
        kept.append(len(proposer.seqs))

    llm.engine.runner.on_hidden = spy
    assert llm.generate(PROMPTS[0], params)[0].token_ids == want
    assert len(kept) >= 12 and not any(kept) and llm.engine.stats.spec.num_drafts == 0


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_equal_a_transformers_reference_of_the_mtp_layer(tmp_path, k):
    """Every draft the engine proposes (its paged latent KV of the MTP layer, caught up in chunks of 5 tokens,
    then chained) equals a full recompute with transformers' DeepseekV3DecoderLayer as the MTP block
    (`mtp_models.reference_drafts`)."""
    from mtp_models import record_drafts, reference_drafts

    hf = random_mtp(tmp_path)
    llm = _nextn(tmp_path, k, chunked_prefill_size=5, page_size=4)
    seen = record_drafts(llm.engine.drafter.model)
    llm.generate(PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(seen) >= 4
    for seq, drafts in seen:
        assert drafts == reference_drafts(hf, seq, len(drafts)), len(seq)
    ext, w = hf.mtp_reference  # the same reference with eh_proj's embedding and hidden halves swapped
    h = w["eh_proj.weight"].shape[0]
    hf.mtp_reference = (ext, {**w, "eh_proj.weight": w["eh_proj.weight"].roll(h, dims=1)})
    assert sum(d == reference_drafts(hf, seq, len(d)) for seq, d in seen) <= len(seen) // 2


def test_no_decode_cuda_graphs_with_nextn_on_a_decoding_role():
    """A decode replay would not write the target's hidden states: no rank captures with NEXTN (tensor
    parallelism: `tests/engine/test_spec_nextn_tp.py`); a prefill worker, which drafts nothing, still does."""
    from pd_cluster.engine.args import config_from_kwargs
    from pd_cluster.engine.spec.drafter import captures_decode_graphs

    assert not captures_decode_graphs(config_from_kwargs(speculative_algorithm="NEXTN"))
    assert not captures_decode_graphs(config_from_kwargs(speculative_algorithm="NEXTN", role="decode"))
    assert captures_decode_graphs(config_from_kwargs(speculative_algorithm="NEXTN", role="prefill"))
    assert captures_decode_graphs(config_from_kwargs(speculative_algorithm="NGRAM"))
