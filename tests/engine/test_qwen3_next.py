"""Qwen3-Next (`engine/model/families/qwen3_next.py`): Gated DeltaNet layers whose recurrent states live in the KV
pool's state group, gated full attention, experts with a gated shared expert.

A tiny random checkpoint written by transformers (`family_models.STATE_FAMILIES`) generates transformers' own
greedy tokens: 5 prompts of 40 to 80 tokens x 32 tokens, fp32 KV, 16-token pages, with chunked prefill of 7 tokens
(each request's state carries across 6 to 12 chunks; also with overlap scheduling) and of 128 (one chunk, whose
delta rule crosses its 64-token blocks); its logits equal transformers'. Each request holds the state group's fixed pages from its first step to
its release; the prefix cache is off for the model, and a repeated prompt is still exact.
"""

from __future__ import annotations

import pytest
import torch
from random_models import build, engine_logits, hf_greedy_batch, hf_logits, long_prompt_ids

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.kv.allocator import NULL_PAGE
from pd_cluster.engine.model.gated_deltanet import GatedDeltaNet
from pd_cluster.engine.model.linear_config import LinearAttentionConfig
from pd_cluster.engine.planner.plan import PlanInput, make_plan
from pd_cluster.engine.planner.spec import load_spec

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
FAMILY = "qwen3-next"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, transformers model, prompts, transformers' greedy tokens)."""
    folder = tmp_path_factory.mktemp("qwen3-next")
    hf = build(FAMILY, folder)
    prompts = long_prompt_ids(5)
    return folder, hf, prompts, hf_greedy_batch(hf, prompts, 32)


@pytest.mark.parametrize("chunk, overlap", [(7, False), (128, False), (7, True)])
def test_greedy_equals_transformers(checkpoint, chunk, overlap):
    folder, _, prompts, want = checkpoint
    llm = LLM(str(folder), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=chunk,
              enable_overlap_schedule=overlap)
    engine = llm.engine
    assert engine.overlap.enabled == overlap
    arch = engine.loaded.arch
    assert [a.kind for a in arch.layer_attention] == ["linear", "linear", "linear", "full"]
    assert [arch.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    assert sum(isinstance(m, GatedDeltaNet) for m in engine.loaded.model.modules()) == 3
    # one request's state: 3 layers x (conv 64 channels x 3 + 4 heads x 8 x 8) float32 = 5,376 B: 2 pages of 4 KiB
    assert arch.linear == LinearAttentionConfig(2, 4, 8, 8, 4)
    assert engine.kv_groups.signature() == ("full:3", "state(2):0,1,2:5376B")
    assert engine.prefix_cache is None
    outs = llm.generate(prompts, GREEDY_32)
    assert [list(o.token_ids) for o in outs] == want
    assert engine.num_free_pages() == engine.allocator.num_pages


def test_logits_equal_transformers(checkpoint):
    folder, hf, prompts, _ = checkpoint
    ids = prompts[4]  # 80 tokens: two blocks of the chunked delta rule
    with torch.no_grad():
        want = hf_logits(hf, ids).float()
    got = engine_logits(folder, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (got - want).abs().max().item()


def test_state_pages_held_per_request_and_freed(checkpoint):
    """Each running request holds exactly the state group's 2 pages, whatever its length, and its full group's
    pages of tokens; all come back when it ends. A prompt repeated, alone and beside itself, gives the same
    tokens (no state is shared or reused)."""
    folder, _, prompts, want = checkpoint
    llm = LLM(str(folder), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    engine = llm.engine
    state = engine.kv_groups.state_group
    seen = []
    for i, ids in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", ids, GREEDY_32)
    while engine.has_work():
        engine.step()
        for req in engine.scheduler.running:
            tables = engine.pages.tables(req)
            seen.append((len(tables[state]), len(tables[0]), req.num_computed_tokens))
            assert NULL_PAGE not in tables[state]
    assert seen and all(n == 2 for n, _, _ in seen)
    assert all(full == -(-computed // 16) for _, full, computed in seen if computed)
    assert engine.num_free_pages() == engine.allocator.num_pages
    again = llm.generate([prompts[1], prompts[1], prompts[0]], GREEDY_32)
    assert [list(o.token_ids) for o in again] == [want[1], want[1], want[0]]
    assert engine.num_free_pages() == engine.allocator.num_pages


def test_small_pool_retracts_and_recomputes_from_a_fresh_state(checkpoint):
    """A pool of 14 pages cannot hold the 5 requests at once (each needs 2 state pages and up to 7 of tokens):
    requests are retracted, their state pages freed and reused by others, and recomputed from position 0 with a
    zeroed state: every output stays transformers'."""
    folder, _, prompts, want = checkpoint
    llm = LLM(str(folder), kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=16, num_pages=14,
              schedule_conservativeness=0.05)
    outs = llm.generate(prompts, GREEDY_32)
    assert [list(o.token_ids) for o in outs] == want
    assert llm.engine.scheduler.num_retracted_total > 0
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages


def test_state_pages_hold_raw_float32_in_an_fp8_pool():
    """`KVPool.write_states` / `read_states` keep a state's float32 bits exactly in an FP8 (uint8) pool, spread
    over a request's pages in table order, and touch no other page."""
    from pd_cluster.engine.kv.groups import plan_kv_groups
    from pd_cluster.engine.kv.pool import KVLayout, KVPool
    from pd_cluster.engine.layer_attention import LayerAttention

    groups = plan_kv_groups((LayerAttention("linear"),) * 3 + (LayerAttention("full"),)).with_state(5_376, 1_024)
    layout = KVLayout(4, 2, 16, 16, "fp8_e4m3", (1.0,) * 4, (1.0,) * 4, layers_per_page=1,
                      kv_groups=groups.signature())
    assert layout.page_nbytes == 1_024 and groups.groups[1].rule == ("state", 6)
    pool = KVPool(layout, 16, "cpu", torch.float32, groups)
    pool.kv.random_(0, 256)
    before = pool.kv.clone()
    tables = torch.tensor([[3, 9, 4, 12, 1, 7], [2, 5, 6, 8, 10, 11]], dtype=torch.int32)
    states = torch.randn(2, 5_376 // 4)
    pool.write_states(tables, states)
    assert torch.equal(pool.read_states(tables, 5_376 // 4), states)
    assert torch.equal(pool.read_states(tables[1:, [1, 0, 2, 3, 4, 5]], 256)[0], states[1, 256:512])
    untouched = [p for p in range(17) if p not in tables.flatten().tolist()]
    assert torch.equal(pool.kv[untouched], before[untouched])


def test_state_pages_travel_with_the_prompts_last_page():
    """A PD ticket of an 80-token prompt (5 pages): the full group's 5 pages, then the state group's 2 pages as two
    transfer groups first at page 4; a push that completes pages 0..3 covers none of the state pages, the last
    push covers them (`KVTicket.slot`)."""
    from pd_cluster.engine.kv.groups import plan_kv_groups
    from pd_cluster.engine.layer_attention import LayerAttention
    from pd_cluster.transfer.ticket import KVTicket, group_slots

    groups = plan_kv_groups((LayerAttention("linear"),) * 3 + (LayerAttention("full"),)).with_state(5_376, 4_096)
    assert [g.rule for g in groups.groups] == [("full", 0), ("state", 2)] and groups.num_transfer_groups == 3
    assert groups.max_pages(80, 8, 16) == 5 + 2 and groups.layers_per_page == 1
    firsts = groups.transfer_first_pages(80, 16)
    assert firsts == (0, 4, 4) and groups.decode_first_pages(80, 16) == (0, 0)
    tables = groups.transfer_tables([[11, 12, 13, 14, 15], [21, 22]], 80, 16)
    slots = group_slots(tables, firsts, 0, 5)
    assert slots == [11, 12, 13, 14, 15, 21, 22]
    ticket = KVTicket("t", "r", "d", "p", tuple(slots), 80, 16, 0, firsts)
    assert ticket.slot(4) == 4 and ticket.slot(5) == 7


@pytest.mark.parametrize("tp", [1, 2])
def test_planner_bytes_per_request_are_the_engines(checkpoint, tp):
    """`pd-plan`'s bytes of one request: the full-attention layer's KV per token plus the state group's whole
    pages, as the engine holds them (`KVGroups.max_pages` pages of the engine's `page_nbytes`)."""
    from pd_cluster.engine.executor.shard import state_pages
    from pd_cluster.engine.kv.groups import plan_kv_groups
    from pd_cluster.engine.kv.pool import KVLayout
    from pd_cluster.engine.model.arch import ArchConfig

    folder = checkpoint[0]
    spec = load_spec(str(folder))
    assert (spec.global_layers, spec.local_layers, spec.state_layers) == (1, 0, 3)
    assert spec.state_bytes_per_request == 3 * (64 * 3 + 4 * 8 * 8) * 4 == 5_376
    plan = make_plan(spec, PlanInput(tp_size=tp, kv_cache_dtype="fp32", page_size=16))
    assert plan.kv_bytes_per_token_per_gpu == 1 * (2 // tp) * 16 * 2 * 4
    arch = ArchConfig.from_pretrained(folder)
    groups = plan_kv_groups(arch.layer_attention)
    rank = type("Rank", (), {"size": tp, "rank": 0})()
    layout = KVLayout(4, 2 // tp, 16, 16, "fp32", (1.0,) * 4, (1.0,) * 4, tp, 0, layers_per_page=1,
                      kv_groups=groups.signature())
    groups, layout = state_pages(groups, layout, arch, rank)
    for tokens in (16, 80, 4096, 100_000):
        assert plan.kv_bytes_for(tokens) == groups.max_pages(tokens, 8, 16) * layout.page_nbytes, tokens


@pytest.mark.parametrize("flag", ["disable_hybrid_kv_cache_manager", "enable_hierarchical_cache"])
def test_settings_without_a_state_group_are_refused(checkpoint, flag):
    with pytest.raises(ValueError, match="state group"):
        LLM(str(checkpoint[0]), kv_cache_dtype="fp32", **{flag: True})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_greedy_equals_transformers(checkpoint):
    """2 ranks over gloo: each holds one of the 2 key heads and 2 of the 4 value heads of every Gated DeltaNet
    layer (its channels of the convolution, its half of the state: 2,688 B, 2 pages of 2 KiB), one of the 2 KV heads and
    half of each expert's width."""
    folder, _, prompts, want = checkpoint
    llm = LLM(str(folder), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    try:
        linear = llm.engine.loaded.model.layers[0].linear_attn
        assert (linear.hk, linear.hv, linear.conv_dim) == (1, 2, 32)
        assert llm.engine.kv_groups.signature() == ("full:3", "state(2):0,1,2:2688B")
        outs = llm.generate(prompts, GREEDY_32)
        assert [list(o.token_ids) for o in outs] == want
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu_pytorch_tanh"), ("attention_bias", True),
                                        ("layer_types", ["linear_attention", "sliding_attention"] * 2)])
def test_keys_it_would_not_honour_are_refused(checkpoint, key, value):
    import json

    from pd_cluster.engine.model.arch import ArchConfig

    cfg = json.loads((checkpoint[0] / "config.json").read_text())
    assert ArchConfig.from_dict(cfg).linear is not None
    with pytest.raises(ValueError, match=key):
        ArchConfig.from_dict({**cfg, key: value})
