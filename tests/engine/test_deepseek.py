"""Acceptance: tiny random DeepSeek-V2 (no q_lora_rank; softmax, group-limited greedy routing) and DeepSeek-V3
(q_lora_rank, YaRN with mscale; sigmoid routing with e_score_correction_bias, grouped top-k, routed_scaling_factor,
a shared expert) checkpoints built with transformers, a dense layer then MoE layers (`deepseek_models`), give
transformers' greedy tokens, over a latent KV pool.

The reference is transformers' own greedy loop by full recompute (no cache).
Prefill runs MLA's expanded form, decode its absorbed form; chunked prefill and
steps that mix decodes with prompt chunks are covered. FP8 latent pages: the
error bound of `test_random_models` (the same model's response to random
relative errors of one FP8 rounding step in its cached ``c`` and ``k_pe``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from deepseek_models import FAMILIES, PROMPTS, build, hf_greedy_recompute, prompt_ids
from random_models import RelativeNoiseCache, row_rel_error

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.attention.mla import TorchMLABackend
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.loader import load_model

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
LONG_IDS = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()
FP8_U = 2.0 ** -4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family, folder, HF model, transformers' greedy tokens of every prompt)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, path)
    refs = [hf_greedy_recompute(hf, prompt_ids(p), MAX_NEW) for p in PROMPTS]
    return request.param, path, hf, refs


def engine_logits(path, ids: list[int], kv_cache_dtype: str = "fp32", page_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill through the engine's model, latent pool and torch MLA backend."""
    lm = load_model(str(path))
    a, m = lm.arch, lm.arch.mla
    n = a.num_hidden_layers
    layout = KVLayout(n, 1, m.latent_dim, page_size, kv_cache_dtype, tuple(lm.k_scales), (1.0,) * n,
                      kv_format="mla")
    pool = KVPool(layout, 64, "cpu", torch.float32)
    backend = TorchMLABackend(a.num_attention_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
                              m.v_head_dim, m.softmax_scale)
    pages = list(range(1, -(-len(ids) // page_size) + 1))
    batch = build_forward_batch([np.array(ids)], [0], [pages], [np.arange(len(ids))], 0, page_size,
                                torch.device("cpu"))
    return lm.model(batch, pool, backend)


def test_prefill_logits_match_transformers_fp32(checkpoint):
    _, path, hf, _ = checkpoint
    with torch.no_grad():
        ref = hf(torch.tensor([LONG_IDS])).logits[0]
    ours = engine_logits(path, LONG_IDS)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


@pytest.mark.parametrize("engine_args", [
    dict(page_size=16),
    dict(page_size=1, chunked_prefill_size=7),
    dict(page_size=64, chunked_prefill_size=5, max_prefill_tokens=9),  # decodes and prompt chunks in one step
], ids=["page16", "page1-chunk7", "page64-mixed-steps"])
def test_greedy_equals_transformers(checkpoint, engine_args):
    _, path, _, refs = checkpoint
    llm = LLM(str(path), kv_cache_dtype="fp32", **engine_args)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out, ref in zip(PROMPTS, outs, refs):
        assert out.token_ids == ref, prompt
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_these_checkpoints_tokens_depend_on_the_routing_details(family, tmp_path):
    """The greedy tests can fail: without the group limit (and V3's correction bias) transformers' own tokens
    change, and the engine's layers 1.. are MoE blocks."""
    hf = build(family, tmp_path)
    ids = prompt_ids(PROMPTS[0])
    ref = hf_greedy_recompute(hf, ids, MAX_NEW)
    for layer in hf.model.layers[1:]:
        layer.mlp.gate.topk_group = layer.mlp.gate.num_group
        if hasattr(layer.mlp.gate, "e_score_correction_bias"):
            assert layer.mlp.gate.e_score_correction_bias.abs().min() > 0
            layer.mlp.gate.e_score_correction_bias.zero_()
    assert hf_greedy_recompute(hf, ids, MAX_NEW) != ref
    layers = load_model(str(tmp_path)).model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MLP"] + ["SparseMoE"] * (len(layers) - 1)


def test_one_at_a_time_and_prefix_cache_hits_on_latent_pages(checkpoint):
    _, path, _, refs = checkpoint
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=4)
    for prompt, ref in zip(PROMPTS, refs):
        assert llm.generate(prompt, GREEDY)[0].token_ids == ref, prompt
    again = llm.generate(PROMPTS[0], GREEDY)[0]  # its full prompt pages are in the prefix cache now
    assert again.num_cached_tokens >= 4 * ((len(prompt_ids(PROMPTS[0])) - 1) // 4)
    assert again.token_ids == refs[0]


def test_pool_holds_one_latent_per_token_sized_by_memory(checkpoint):
    family, path, _, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    small = LLM(str(path), kv_cache_dtype="fp32", page_size=16, kv_cache_memory="4MiB")
    lay = small.engine.pool.layout
    assert (lay.kv_format, lay.num_kv_heads, lay.head_dim) == ("mla", 1, latent)
    assert lay.page_nbytes == cfg["num_hidden_layers"] * 16 * latent * 4  # not K and V per head
    assert small.engine.pool.kv.shape[2:] == (1, 1, 16, latent)
    huge_context = LLM(str(path), kv_cache_dtype="fp32", page_size=16, kv_cache_memory="4MiB",
                       context_length=10_000_000)
    assert huge_context.engine.pool.num_pages == small.engine.pool.num_pages == 4 * 2**20 // lay.page_nbytes - 1


def test_fp8_latent_error_within_bound(checkpoint, capsys):
    family, path, hf, _ = checkpoint
    x = torch.tensor([LONG_IDS])
    with torch.no_grad():
        ref = hf(x).logits[0]
        noise = [row_rel_error(hf(x, cache=RelativeNoiseCache(FP8_U, s, config=hf.config)).logits[0], ref)
                 for s in range(3)]
    e_fp8 = row_rel_error(engine_logits(path, LONG_IDS, "fp8_e4m3"), ref)
    e_fp32 = row_rel_error(engine_logits(path, LONG_IDS, "fp32"), ref)
    e_noise = sum(noise) / len(noise)
    with capsys.disabled():
        print(f"\n[{family}] FP8 latent: relative logit error {e_fp8:.4f} (fp32 latent {e_fp32:.2e}); "
              f"relative-noise(u=2^-4) baseline {e_noise:.4f}")
    assert 0.1 * e_noise < e_fp8 <= 1.5 * e_noise


def test_fp8_greedy_agreement_reported(checkpoint, capsys):
    """FP8 vs fp32 latent pages over 32 tokens (reported; FP8 is not expected to be exact)."""
    family, path, _, refs = checkpoint
    fp8 = LLM(str(path), kv_cache_dtype="fp8_e4m3").generate(PROMPTS, GREEDY)
    prefix = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r)) if a != b), MAX_NEW) for o, r in zip(fp8, refs)]
    same = sum(a == b for o, r in zip(fp8, refs) for a, b in zip(o.token_ids, r))
    with capsys.disabled():
        print(f"\n[{family}] FP8 vs fp32 latent greedy: identical prefix lengths {prefix} of {MAX_NEW}; "
              f"{same}/{MAX_NEW * len(PROMPTS)} positions equal")
    assert all(len(o.token_ids) == MAX_NEW for o in fp8)


@pytest.mark.parametrize("key,value,needle", [
    ("topk_method", "sinkhorn", "unsupported topk_method 'sinkhorn'"),
    ("scoring_func", "softmax", "topk_method 'noaux_tc' with scoring_func 'softmax' is not implemented"),
    ("hidden_act", "gelu", "hidden_act='gelu' is not implemented"),
    ("attention_bias", True, "attention_bias=True is not implemented (DeepseekV3ForCausalLM without attention"),
    ("mlp_bias", True, "mlp_bias=True is not implemented"),
])
def test_configs_it_cannot_run_are_refused_by_name(tmp_path, key, value, needle):
    build("deepseek-v3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path))
    assert needle in str(e.value)


def test_host_tier_spills_and_loads_back_latent_pages(checkpoint):
    """HiCache on latent pages: a device pool of 24 pages (96 tokens, two requests) evicts; pages spill to the host and load back on the
    second round; every token is still transformers'."""
    _, path, _, refs = checkpoint
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=4, num_pages=24, max_running_requests=1,
              enable_hierarchical_cache=True, hicache_ratio=4.0)
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == refs
    host = llm.engine.host_tier
    assert host.backup_pages_total > 0 and host.load_back_pages_total > 0
    assert host.copier.kv.shape[1:] == llm.engine.pool.kv.shape[1:]  # the host pages are latent pages
    assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
