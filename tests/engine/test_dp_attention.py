"""DP attention on CPU (SGLang's ``--tp-size 2 --dp-size 2 --enable-dp-attention``): two DP rank processes over
gloo, each with its own requests, scheduler and KV pool and the attention weights whole; the MoE layers gather
both ranks' tokens and split the experts by width, or hold them whole with ``enable_expert_parallel`` and send
each token to the ranks of its experts (routed all-to-all). Greedy tokens of a
batch spread unevenly over the ranks (so a rank idles some steps) equal transformers' greedy loop and the TP-1
engine's, with fp32 KV. Start-up refusals name the flag."""

from __future__ import annotations

import pytest
from deepseek_models import build as build_deepseek
from deepseek_models import hf_greedy_recompute
from random_models import build as build_random
from random_models import hf_greedy_batch, prompt_ids

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.config import ParallelConfig
from pd_cluster.engine.executor.dp import check_dp_attention

# five prompts of different lengths and output lengths: the first rank gets three of them, and the shorter
# outputs finish early, so some steps have work on one rank only
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 6, 14, 3, 9)]
DP = dict(tp_size=2, dp_size=2, enable_dp_attention=True, kv_cache_dtype="fp32", page_size=16,
          chunked_prefill_size=7)


def _check(path, hf_refs, expert_parallel, tp1_tokens, want_experts):
    llm = LLM(str(path), enable_expert_parallel=expert_parallel, **DP)
    engine = llm.engine
    try:
        info = engine.rank_info
        assert [i["experts"] for i in info] == want_experts
        assert info[0]["attention_heads"] == info[1]["attention_heads"]  # attention whole on every DP rank
        prompts = prompt_ids(5)
        outs = llm.generate(prompts, PARAMS)
        for p, out, ref, tp1 in zip(PARAMS, outs, hf_refs, tp1_tokens):
            assert list(out.token_ids) == ref[:p.max_tokens] == tp1
        # least loaded, lowest rank on a tie: ranks 0, 1, 0, 1, 0; rank 1's two requests (6 and 3 tokens) end
        # while rank 0 still decodes, so rank 1 ran idle passes
        assert engine.idle_steps[1] > 0
        pinned = llm.generate(prompts[:2], PARAMS[:2], data_parallel_rank=0)  # SGLang's field: both on rank 0
        assert [list(o.token_ids) for o in pinned] == [r[:p.max_tokens] for r, p in zip(hf_refs, PARAMS[:2])]
        load = engine.load()
        assert [r["num_running_reqs"] for r in load["dp_ranks"]] == [0, 0]
        assert all(r["num_free_pages"] == r["num_total_pages"] for r in load["dp_ranks"])  # no page leaked
    finally:
        engine.close()
    return info


def _tp1_tokens(path, prompts):
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    try:
        return [list(o.token_ids) for o in llm.generate(prompts, PARAMS)]
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_qwen3_moe_dp2_greedy_equals_transformers_and_tp1(expert_parallel, tmp_path):
    hf = build_random("qwen3-moe", tmp_path)
    prompts = prompt_ids(5)
    refs = hf_greedy_batch(hf, prompts, 20)
    # 4 experts of width 32: whole, two per rank (EP), or all four at half width
    want = [(0, 2, (2, 64, 64)), (2, 2, (2, 64, 64))] if expert_parallel else [(0, 4, (4, 32, 64))] * 2
    _check(tmp_path, refs, expert_parallel, _tp1_tokens(tmp_path, prompts), want)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_deepseek_v3_dp2_greedy_equals_transformers_and_tp1(expert_parallel, tmp_path):
    hf = build_deepseek("deepseek-v3", tmp_path)
    prompts = prompt_ids(5)
    refs = [hf_greedy_recompute(hf, ids, 20) for ids in prompts]
    want = [(0, 2, (2, 64, 64)), (2, 2, (2, 64, 64))] if expert_parallel else [(0, 4, (4, 32, 64))] * 2
    # the shared expert (32 wide): whole on each rank with the routed all-to-all (EP), else half on each
    info = _check(tmp_path, refs, expert_parallel, _tp1_tokens(tmp_path, prompts), want)
    assert [i["shared_width"] for i in info] == [32 if expert_parallel else 16] * 2


def _config(path, **parallel):
    return config_from_kwargs(model=str(path), **parallel)


@pytest.mark.parametrize("parallel, message", [
    (dict(tp_size=2, dp_size=1, enable_dp_attention=True), "--enable-dp-attention needs --dp-size > 1"),
    (dict(tp_size=3, dp_size=2, enable_dp_attention=True), "--dp-size 2 must divide --tp-size 3"),
    (dict(tp_size=2, dp_size=2), "--dp-size 2 without --enable-dp-attention"),
    (dict(tp_size=4, dp_size=2, enable_dp_attention=True), "tensor-parallel attention inside a DP rank"),
])
def test_dp_flags_are_refused_naming_the_flag(parallel, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**parallel)


def test_models_dp_attention_cannot_serve_are_refused_before_any_rank_starts(tmp_path):
    build_random("qwen3-moe", tmp_path / "moe6", num_experts=6)
    with pytest.raises(ValueError, match=r"--tp-size 4 with --enable-expert-parallel must divide the number of "
                                         r"experts \(6\)"):
        check_dp_attention(_config(tmp_path / "moe6", tp_size=4, dp_size=4, enable_dp_attention=True,
                                   enable_expert_parallel=True))
    build_random("llama-gqa4", tmp_path / "dense")
    with pytest.raises(ValueError, match="--enable-dp-attention is built for mixture-of-experts models only"):
        check_dp_attention(_config(tmp_path / "dense", tp_size=2, dp_size=2, enable_dp_attention=True))
    with pytest.raises(ValueError, match="--enable-dp-attention is built for the offline engine"):
        LLM(str(tmp_path / "moe6"), role="decode", tp_size=2, dp_size=2, enable_dp_attention=True)
    # a decode worker's DP instance (decode/dp_instance.py) runs the decode role only
    with pytest.raises(ValueError, match="built for decode workers .*, not role prefill"):
        check_dp_attention(_config(tmp_path / "moe6", tp_size=2, dp_size=2, enable_dp_attention=True,
                                   role="prefill"), roles=("decode",))


def test_dp_rank_choice_pins_or_takes_the_least_loaded_lowest_rank():
    from pd_cluster.engine.errors import RequestRejected
    from pd_cluster.engine.executor.dp import pick_dp_rank

    assert pick_dp_rank([0, 0]) == 0 and pick_dp_rank([1, 0]) == 1 and pick_dp_rank([2, 1, 1]) == 1
    assert pick_dp_rank([0, 5], data_parallel_rank=1) == 1  # pinned, whatever the load
    for bad in (2, -1, True, "1", 1.0):
        with pytest.raises(RequestRejected, match="data_parallel_rank"):
            pick_dp_rank([0, 0], data_parallel_rank=bad)
