"""Acceptance: prefill and decode at different TP sizes through `pd-serve --prefill-arg=--tp-size=N
--decode-arg=--tp-size=M`, on tiny random checkpoints written by transformers (fp32 KV): the KV heads are split or
merged on the way (GQA), or the replicated MLA latent is sent once per decode rank, and the real `openai` client
gets transformers' own greedy tokens; every page comes back on both sides, and the bytes decode received are what
its ranks hold of every prompt page (no head twice, none missing)."""

from __future__ import annotations

import openai
import pytest
from cluster_util import greedy_token_ids, running_pd_serve
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]
MAX_TOKENS = 16


def _tp(prefill: int, decode: int) -> list[str]:
    return [f"--prefill-arg=--tp-size={prefill}", f"--decode-arg=--tp-size={decode}"]


def _serve_and_compare(tmp_path, model, prompts, expected, tp_argv, page_bytes_per_rank, decode_tp):
    """Serve `model` with `tp_argv`; each prompt's greedy tokens must be `expected`'s; decode's received bytes must
    be its ranks' pages of every prompt page (`page_bytes_per_rank`: one decode rank's bytes per page)."""
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(model), *ENGINE, *tp_argv]) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        assert greedy_token_ids(url, model.name, prompts, MAX_TOKENS) == expected
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        decode = counters(workers["decode"])
    received, saved = decode["pd:kv_transfer_received_bytes_total"], decode.get("pd:kv_transfer_saved_bytes_total", 0)
    pages = sum(-(-len(ids) // 16) for ids in prompts)
    assert pushed == received and received + saved == pages * page_bytes_per_rank * decode_tp, (pushed, saved, pages)
    return saved


def _gqa_page_bytes(hf, decode_tp: int) -> int:
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * (c.num_key_value_heads // decode_tp) * 16 * head_dim * 4


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from random_models import build, hf_greedy_batch, long_prompt_ids

    model = tmp_path_factory.mktemp("llama3") / "llama3-tiny"
    hf = build("llama3-rope-scaling", model, num_key_value_heads=4)  # two KV heads per rank at TP 2
    prompts = long_prompt_ids(2, (40, 53))
    prompts.append(prompts[0][:33] + prompts[1][:7])  # two pages in decode's prefix cache: a delta transfer
    return model, hf, prompts, hf_greedy_batch(hf, prompts, MAX_TOKENS)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 4)])
def test_llama3_gqa_heads_split_and_merged(tmp_path, llama3, prefill_tp, decode_tp):
    model, hf, prompts, expected = llama3
    saved = _serve_and_compare(tmp_path, model, prompts, expected, _tp(prefill_tp, decode_tp),
                               _gqa_page_bytes(hf, decode_tp), decode_tp)
    assert saved == 2 * _gqa_page_bytes(hf, decode_tp) * decode_tp  # the third prompt's first two pages


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from random_models import build, hf_greedy_batch, prompt_ids

    model = tmp_path_factory.mktemp("qwen3-moe") / "qwen3-moe-tiny"
    hf = build("qwen3-moe", model)
    prompts = prompt_ids(3)
    return model, hf, prompts, hf_greedy_batch(hf, prompts, MAX_TOKENS)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_qwen3_moe_heads_merged_and_split(tmp_path, qwen3_moe, prefill_tp, decode_tp):
    model, hf, prompts, expected = qwen3_moe
    _serve_and_compare(tmp_path, model, prompts, expected, _tp(prefill_tp, decode_tp),
                       _gqa_page_bytes(hf, decode_tp), decode_tp)


def test_deepseek_v3_mla_p2_d1(tmp_path):
    """The latent is the same on both prefill ranks: decode's one rank receives it once (from prefill rank 0)."""
    from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids

    model = tmp_path / "deepseek-v3-tiny"
    hf = build("deepseek-v3", model)
    prompts = [prompt_ids(p) for p in PROMPTS[:3]]
    expected = [hf_greedy_recompute(hf, ids, MAX_TOKENS) for ids in prompts]
    c = hf.config
    latent_page = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 16 * 4
    _serve_and_compare(tmp_path, model, prompts, expected, _tp(2, 1), latent_page, 1)


def test_gemma3_hybrid_kv_groups_p2_d1(tmp_path):
    """Hybrid KV groups (one global layer, five sliding-window layers, a page per group): each prefill rank pushes its
    KV head of the slots decode reads (every global page, the last window of the local ones) into decode's one rank."""
    from random_models import build, hf_greedy_batch, long_prompt_ids

    from pd_cluster.engine.kv.groups import plan_kv_groups
    from pd_cluster.engine.model.arch import ArchConfig

    model = tmp_path / "gemma3"
    hf = build("gemma3", model)
    prompts = long_prompt_ids(2)
    groups = plan_kv_groups(ArchConfig.from_pretrained(model).layer_attention)
    firsts = [groups.transfer_first_pages(len(ids), 16) for ids in prompts]
    assert all(min(f[1:]) > 0 for f in firsts)  # pages behind the windows are not moved
    moved = sum(groups.num_groups * -(-len(ids) // 16) - sum(f) for ids, f in zip(prompts, firsts))
    page_nbytes = groups.layers_per_page * 2 * hf.config.num_key_value_heads * 16 * hf.config.head_dim * 4
    with running_pd_serve(tmp_path / "manifest.json", ["--model", str(model), *ENGINE, *_tp(2, 1)]) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for ids, want in zip(prompts, hf_greedy_batch(hf, prompts, MAX_TOKENS)):
            r = client.completions.create(model=model.name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].model_dump()["token_ids"] == want, len(ids)
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        assert pushed == counters(workers["decode"])["pd:kv_transfer_received_bytes_total"] == moved * page_nbytes
