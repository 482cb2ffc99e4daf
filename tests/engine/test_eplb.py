"""Expert-parallel load balancing (EPLB: ``--ep-num-redundant-experts``, ``--enable-eplb``,
``--eplb-rebalance-num-iterations``).

The placement (DeepSeek's replicate-then-pack) is checked on its own: every expert held, the busiest replicated,
ranks balanced, slots kept. On real ranks (gloo, two OS processes) a tiny DeepSeek-V3 built by transformers,
under TP 2 with expert parallelism and under DP attention, with two redundant experts and a rebalance every few
steps, gives transformers' greedy tokens while its experts move between the ranks; the load it records per
expert is transformers' own routing of the same tokens. Bad settings are refused naming the flag.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.model.eplb import ExpertLocation, initial_placement, place, replicate

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
EPLB = dict(page_size=16, kv_cache_dtype="fp32", chunked_prefill_size=7, enable_expert_parallel=True,
            ep_num_redundant_experts=2, enable_eplb=True, eplb_rebalance_num_iterations=3, disable_radix_cache=True)


def test_initial_placement_keeps_the_loaded_experts_and_replicates_the_next_ranks():
    # 8 experts, 4 redundant, 4 ranks: rank r loads experts 2r, 2r + 1 and replicates rank r + 1's first one
    assert initial_placement(8, 4, 4) == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 0]


def test_replicas_go_to_the_most_load_per_replica():
    assert replicate([100, 10, 10, 1], 2) == [3, 1, 1, 1]
    assert replicate([30, 20, 10, 5], 3) == [3, 2, 1, 1]  # 30 -> 15, then 20 -> 10, then 15 -> 10
    assert replicate([10, 10, 10, 10], 2) == [2, 2, 1, 1]  # a tie: the lowest id


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2), st.data())
def test_place_holds_every_expert_balances_the_ranks_and_keeps_slots(ranks, per_rank, extra_per_rank, data):
    experts = ranks * per_rank
    redundant = ranks * extra_per_rank
    load = data.draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))
    current = initial_placement(experts, redundant, ranks)
    new = place([float(x) for x in load], redundant, ranks, current)
    slots = (experts + redundant) // ranks
    assert len(new) == experts + redundant and set(new) == set(range(experts))
    counts = replicate([float(x) for x in load], redundant)
    assert [new.count(e) for e in range(experts)] == counts
    rank_load = [sum(load[e] / counts[e] for e in new[r * slots:(r + 1) * slots]) for r in range(ranks)]
    heaviest = max((load[e] / counts[e] for e in range(experts)), default=0.0)
    assert max(rank_load) <= sum(rank_load) / ranks + heaviest + 1e-6  # greedy packing's bound
    for p, e in enumerate(new):  # an expert that stays on a rank keeps a slot it had there
        r = p // slots
        if current[p] != e and e in current[r * slots:(r + 1) * slots]:
            kept = [q for q in range(r * slots, (r + 1) * slots) if current[q] == e]
            assert any(new[q] == e for q in kept), (current, new)


def test_a_token_s_choices_spread_over_an_expert_s_replicas_and_load_is_counted():
    loc = ExpertLocation([0, 1, 0, 2, 0, 3], num_experts=4, num_redundant=2)  # expert 0 in slots 0, 2, 4
    ids = torch.tensor([[0, 1]] * 6 + [[3, 0]] * 3)
    phys = loc.to_physical(ids)
    assert torch.equal(loc.physical_to_logical[phys], ids)  # every choice lands on a replica of its expert
    zero = phys[ids == 0].tolist()
    assert sorted(zero.count(s) for s in (0, 2, 4)) == [3, 3, 3]  # 9 choices of expert 0, 3 per replica
    loc.record(ids)
    assert loc.load.tolist() == loc.total_load.tolist() == [9, 6, 0, 3]
    loc.update([3, 2, 1, 0, 0, 0])
    assert loc.replicas.tolist() == [3, 1, 1, 1] and loc.logical_to_physical[0].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="every expert at least once"):
        loc.update([0, 0, 0, 1, 2, 2])


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep_num_redundant_experts=2), "need expert parallelism"),
    (dict(enable_eplb=True, tp_size=2), "need expert parallelism"),
    (dict(ep_num_redundant_experts=-1, enable_expert_parallel=True), "--ep-num-redundant-experts must be >= 0"),
    (dict(eplb_rebalance_num_iterations=0), "--eplb-rebalance-num-iterations must be >= 1"),
    (dict(eplb_rebalance_num_iterations=10, enable_expert_parallel=True, tp_size=2),
     "--eplb-rebalance-num-iterations needs --enable-eplb"),
    (dict(enable_eplb=True, enable_expert_parallel=True, prefill_context_parallel_size=2),
     "with --prefill-context-parallel-size is not built"),
])
def test_bad_eplb_settings_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config_from_kwargs(**kwargs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_redundant_experts_that_do_not_fill_the_ranks_or_one_rank_are_refused_before_any_rank_starts(tmp_path):
    build("deepseek-v3", tmp_path)
    with pytest.raises(ValueError, match=r"--ep-num-redundant-experts 1: the 4 experts .* multiple of the "
                                         r"expert-parallel size 2"):
        LLM(str(tmp_path), tp_size=2, enable_expert_parallel=True, ep_num_redundant_experts=1)
    with pytest.raises(ValueError, match="need expert parallelism over several ranks"):
        LLM(str(tmp_path), enable_expert_parallel=True, enable_eplb=True)


def _hf_load(hf, sequences: list[list[int]]) -> list[list[int]]:
    """transformers' routing: (token, choice) pairs per expert of each MoE layer over `sequences` (full
    recompute, the tokens an engine runs: each prompt and its outputs but the last)."""
    layers = [layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    counts = [torch.zeros(hf.config.n_routed_experts, dtype=torch.int64) for _ in layers]

    def counter(c: torch.Tensor):
        def hook(module, args, out) -> None:  # out: (router logits, top-k weights, top-k expert ids)
            c.add_(torch.bincount(out[2].reshape(-1), minlength=c.numel()))
        return hook

    hooks = [m.gate.register_forward_hook(counter(c)) for m, c in zip(layers, counts)]
    try:
        with torch.no_grad():
            for seq in sequences:
                hf(torch.tensor([seq]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [c.tolist() for c in counts]


def _check_stats(stats: dict, slots: int = 6) -> None:
    assert stats["rebalances"] == stats["iterations"] // 3 >= 2 and stats["experts_moved"] > 0, stats
    for layer in stats["layers"]:
        placement = layer["placement"]
        assert len(placement) == slots and set(placement) == {0, 1, 2, 3}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp_attention", [False, True], ids=["tp2-ep", "dp2-ep"])
def test_rebalancing_experts_mid_generation_keeps_transformers_tokens_and_counts_its_routing(dp_attention, tmp_path):
    hf = build("deepseek-v3", tmp_path)
    ids = [prompt_ids(p) for p in PROMPTS]
    refs = [hf_greedy_recompute(hf, p, MAX_TOKENS) for p in ids]
    dp = dict(dp_size=2, enable_dp_attention=True) if dp_attention else {}
    llm = LLM(str(tmp_path), tp_size=2, **dp, **EPLB)
    try:
        outs = llm.generate(ids, GREEDY)
        assert [list(o.token_ids) for o in outs] == refs
        stats = llm.engine.expert_distribution()
        per_rank = stats if dp_attention else [stats]
        for s in per_rank:
            _check_stats(s)
        if dp_attention:  # both ranks placed the experts alike (one decision from the summed load)
            assert per_rank[0]["layers"][0]["placement"] == per_rank[1]["layers"][0]["placement"]
        load = [[sum(s["layers"][i]["total_load"][e] for s in per_rank) for e in range(4)]
                for i in range(len(per_rank[0]["layers"]))]
        assert load == _hf_load(hf, [p + r[:-1] for p, r in zip(ids, refs)])
        again = llm.generate(ids[:2], GREEDY)  # after the rebalances, from a new placement
        assert [list(o.token_ids) for o in again] == refs[:2]
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["deepseek-v3-fp8", "gpt-oss-mxfp4"])
def test_quantised_experts_move_whole_with_their_scales_and_biases(family, tmp_path):
    """FP8-block experts (values and block scales) and MXFP4 experts (codes, E8M0 scales and biases) rebalanced
    between two ranks give transformers' greedy tokens on the dequantised twin."""
    from quant_models import deepseek_fp8, gpt_oss_mxfp4

    build_q = (lambda root: deepseek_fp8(root, v_head_dim=32)) if family.startswith("deepseek") else gpt_oss_mxfp4
    path, _, prompts, hf_greedy = build_q(tmp_path)
    llm = LLM(str(path), tp_size=2, **EPLB)
    try:
        experts = llm.engine.loaded.model.layers[1 if family.startswith("deepseek") else 0].mlp.experts
        moved = [n for n in experts.named_parameters(recurse=False)]
        assert all(p.shape[0] == 3 for n, p in moved if p.dim() >= 2), [(n, p.shape) for n, p in moved]  # 2 + 1
        assert experts.w13_weight.dtype in (torch.float8_e4m3fn, torch.uint8)  # held quantised
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        for ids, out in zip(prompts, outs):
            assert list(out.token_ids) == hf_greedy(ids), len(ids)
        stats = llm.engine.expert_distribution()
        assert stats["rebalances"] >= 2 and stats["experts_moved"] > 0, stats
    finally:
        llm.engine.close()
