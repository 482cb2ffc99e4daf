"""Acceptance: a long prompt's logprobs through `pd-serve` 1P1D. The prefill worker computes every position's
logprob and top 20 (vLLM's ``prompt_logprobs``, the maximum it takes) and sends them to the decode worker in the
notification of the last KV push over NIXL; for 6,000 tokens that is 6,000 x 21 entries, a multi-megabyte message,
where the other PD tests send a few hundred positions. Every logprob equals transformers' log-softmax of its own
logits at that position, each top-20 is transformers' top 20, the ranks agree with the logprobs, and every page
comes back on both sides."""

from __future__ import annotations

import httpx
import pytest
import torch
from cluster_util import running_pd_serve
from random_models import build, hf_logits, prompt_ids
from test_moe_pd_serve import _wait_all_free

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

N_TOKENS = 6000
TOP = 20


@pytest.mark.timeout(600)
def test_6000_token_prompt_logprobs_top_20_equal_transformers(tmp_path):
    model = tmp_path / "llama"
    hf = build("llama-gqa4", model, max_position_embeddings=8192)
    base = sum(prompt_ids(5), [])
    ids = (base * (N_TOKENS // len(base) + 1))[:N_TOKENS]
    with torch.no_grad():
        ref = torch.log_softmax(hf_logits(hf, ids).float(), dim=-1)  # [N_TOKENS, vocab]; row i predicts ids[i + 1]
    argv = ["--model", str(model), "--kv-cache-dtype", "fp32", "--chunked-prefill-size", "1024",
            "--context-length", "8192", "--kv-cache-memory", "1GiB"]
    with running_pd_serve(tmp_path / "manifest.json", argv) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"model": model.name, "prompt": ids, "max_tokens": 2, "temperature": 0,
                             "prompt_logprobs": TOP})
        assert r.status_code == 200, r.text[:2000]
        assert len(r.content) > 4_000_000  # the payload this test is about: megabytes, not kilobytes
        plp = r.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and len(plp) == N_TOKENS
        worst, eps = 0.0, 1e-4  # eps: fp32 differences between two implementations; near-ties may swap within it
        for pos in range(1, N_TOKENS):
            entry, row = plp[pos], ref[pos - 1]
            got = {int(t): v for t, v in entry.items()}
            chosen, mine = got[ids[pos]], float(row[ids[pos]])
            assert len(got) in (TOP, TOP + 1), pos
            # the top 20 are transformers' top 20: no token below its 20th logprob (near-ties aside)
            twentieth = float(torch.topk(row, TOP).values[-1])
            assert all(float(row[t]) >= twentieth - eps for t in got if t != ids[pos]), pos
            # the rank is 1 + how many tokens transformers gives a higher logprob
            assert 1 + int((row > mine + eps).sum()) <= chosen["rank"] <= 1 + int((row > mine - eps).sum()), pos
            worst = max(worst, max(abs(v["logprob"] - float(row[t])) for t, v in got.items()))
        assert worst < eps, worst
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
