"""Acceptance: `pd-serve` 1P1D with NEXTN (``--speculative-algorithm NEXTN --speculative-num-draft-tokens 2``) over
a tiny DeepSeek-V3 built by transformers with an MTP layer added in the release's tensor names (`mtp_models`, the
one that predicts the target's next token). The prefill worker pushes the target's latent pages as always and
sends nothing for the MTP layer; the decode worker runs the MTP layer over the tokens it computes itself, from the
request's first decode step on (`pd_cluster.engine.spec.nextn`). The real `openai` client gets transformers'
greedy tokens (full recompute), and the same text streamed; the decode's ``vllm:spec_decode_*`` counters show drafts
accepted, the prefill's none; every page comes back, the MTP pool's included."""

from __future__ import annotations

import openai
import pytest
from cluster_util import running_pd_serve
from deepseek_models import PROMPTS, hf_greedy_recompute, prompt_ids
from mtp_models import echo_mtp
from test_moe_pd_serve import _all_free, _wait_all_free
from test_spec_pd_serve import spec_totals

pytestmark = pytest.mark.slow  # starts processes

MAX_TOKENS = 24
NAME = "deepseek-v3-mtp"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("nextn")
    hf = echo_mtp(root / "model")
    argv = ["--model", str(root / "model"), "--served-model-name", NAME, "--kv-cache-dtype", "fp32",
            "--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "2"]
    with running_pd_serve(root / "manifest.json", argv) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), workers, hf


@pytest.mark.timeout(400)
def test_1p1d_nextn_greedy_equals_transformers(served):
    client, workers, hf = served
    for prompt in PROMPTS[:3]:
        want = hf_greedy_recompute(hf, prompt_ids(prompt), MAX_TOKENS)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_dump()["token_ids"] == want, prompt
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text, prompt
    total = spec_totals(workers)
    assert total("decode", "num_drafts") > 0 and total("prefill", "num_drafts") == 0
    assert total("decode", "num_accepted_tokens") > total("decode", "num_draft_tokens") // 2
    loads = _wait_all_free(workers, 30)
    assert all(_all_free(v) for v in loads.values()), loads
    assert loads["decode"]["draft_num_total_pages"] > 0 and "draft_num_total_pages" not in loads["prefill"]
