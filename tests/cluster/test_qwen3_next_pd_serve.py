"""Acceptance: `pd-serve` 1P1D, at TP 1 and TP 2, on Qwen3-Next (`family_models.STATE_FAMILIES`): the prefill
worker computes each prompt in chunks of 8 tokens and pushes over NIXL its pages of the full-attention layer and,
with the prompt's last page, the pages of the state group holding the Gated DeltaNet layers' recurrent states at
the prompt's end; the decode worker decodes from them. The real `openai` client gets transformers' greedy tokens,
the bytes pushed are the bytes received (state pages included), and every page comes back on both sides."""

from __future__ import annotations

import pytest
from cluster_util import greedy_token_ids, running_pd_serve
from random_models import build, hf_greedy_batch, long_prompt_ids
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8"]
# per request and rank: full-attention pages of the prompt, plus the state group's 2 pages (TP 1: 4 KiB pages,
# a 5,376 B state; TP 2: 2 KiB pages, a 2,688 B state)
PAGE_BYTES = {1: 4096, 2: 2048}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_next_1p1d_moves_the_states_and_equals_transformers(tp, tmp_path):
    model = tmp_path / "qwen3-next"
    hf = build("qwen3-next", model)
    prompts = long_prompt_ids(5)
    expected = hf_greedy_batch(hf, prompts, 32)
    argv = ["--model", str(model), *ENGINE, "--tp-size", str(tp)]
    with running_pd_serve(tmp_path / "manifest.json", argv) as (url, manifest):
        assert greedy_token_ids(url, model.name, prompts, 32) == expected
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        assert pushed == counters(workers["decode"])["pd:kv_transfer_received_bytes_total"]
        pages = sum(-(-len(ids) // 16) + 2 for ids in prompts)
        assert pushed == pages * PAGE_BYTES[tp] * tp
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
