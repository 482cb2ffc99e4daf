"""Acceptance: `pd-serve` 1P1D with NEXTN (``--speculative-algorithm NEXTN --speculative-num-draft-tokens 3``: 2 drafts
per step) over a tiny DeepSeek-V3 built by transformers with an MTP layer added in the release's tensor names
(`mtp_models`, the one that predicts the target's next token). The prefill worker pushes the target's latent pages
as always and sends nothing for the MTP layer; the decode worker runs the MTP layer over the tokens it computes
itself, from the request's first decode step on (`pd_cluster.engine.spec.nextn`). The real `openai` client gets
transformers' greedy tokens (full recompute), and the same text streamed; the decode's ``vllm:spec_decode_*``
counters show drafts accepted, the prefill's none; every page comes back, the MTP pool's included. The same at
``--tp-size 2`` on both workers (the MTP layer whole on the decode's rank 0), where a ``response_format``
json_schema completion also equals the engine's without speculation, token for token, and is valid JSON."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest
from cluster_util import running_pd_serve
from deepseek_models import PROMPTS, hf_greedy_recompute, prompt_ids
from mtp_models import echo_mtp
from test_moe_pd_serve import _all_free, _wait_all_free
from test_openai_structured import FORMAT, SCHEMA
from test_spec_pd_serve import spec_totals

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.sampling.structured import StructuredOutput

pytestmark = pytest.mark.slow  # starts processes

MAX_TOKENS = 24
NAME = "deepseek-v3-mtp"
KEY, KEY_ENV = "test-internal-key", "PD_INTERNAL_API_KEY"


def _serve(root, extra=()):
    hf = echo_mtp(root / "model")
    argv = ["--model", str(root / "model"), "--served-model-name", NAME, "--kv-cache-dtype", "fp32",
            "--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "3", *extra]
    before = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = KEY  # pd-serve's internal key, so the test may read the agents' info
    try:
        with running_pd_serve(root / "manifest.json", argv) as (url, manifest):
            workers = {w["role"]: w["url"] for w in manifest["workers"]}
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            yield client, workers, hf, root / "model"
    finally:
        if before is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = before


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("nextn"))


@pytest.fixture(scope="module")
def served_tp2(tmp_path_factory):
    yield from _serve(tmp_path_factory.mktemp("nextn-tp2"), ["--tp-size", "2"])


@pytest.mark.timeout(400)
def test_1p1d_nextn_greedy_equals_transformers(served):
    _check_greedy(*served[:3])


@pytest.mark.timeout(400)
def test_1p1d_tp2_nextn_greedy_and_json_equal_no_speculation(served_tp2):
    client, workers, hf, path = served_tp2
    _check_greedy(client, workers, hf)
    drafts = spec_totals(workers)("decode", "num_drafts")
    prompt = PROMPTS[1]
    structured = StructuredOutput(json_schema=SCHEMA, param="response_format")
    want = LLM(str(path), kv_cache_dtype="fp32").generate(
        prompt, SamplingParams(max_tokens=200, temperature=0.0, structured_output=structured))[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=200, temperature=0,
                                  extra_body={"response_format": FORMAT, "return_token_ids": True})
    assert r.choices[0].model_dump()["token_ids"] == want.token_ids and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text, strict=False), SCHEMA)  # strict: see test_spec_structured
    assert spec_totals(workers)("decode", "num_drafts") > drafts  # the JSON request was drafted too
    loads = _wait_all_free(workers, 30)
    assert all(_all_free(v) for v in loads.values()), loads


def _check_greedy(client, workers, hf):
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
    for role, url in workers.items():  # what each side advertises at the KV transfer handshake
        info = httpx.get(url + "/kv_transfer/info", headers={"X-PD-Internal-Key": KEY}, timeout=10).json()
        spec = info["speculative"]
        assert spec["speculative"].startswith("NEXTN k=2") and spec["draft_state"] == [], (role, spec)
