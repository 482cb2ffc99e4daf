"""Acceptance: `pd-serve` 1P1D with a draft model (``--speculative-algorithm STANDALONE
--speculative-draft-model-path``; stories260K's first 4 layers, written by transformers): the draft runs on the
decode worker only, which computes the draft's KV of each prompt itself at the request's first decode step;
the prefill worker sends the target's KV as always. The real `openai` client gets the greedy tokens of the
engine without speculation, streamed or not, and with ``response_format`` json_schema the same valid JSON;
sampled JSON is always valid; the decode worker's ``vllm:spec_decode_*`` counters show drafts accepted and
rejected; every page comes back, the draft pool's included."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from cluster_util import running_pd_serve
from draft_models import shallow_stories_draft
from test_moe_pd_serve import _all_free, _wait_all_free
from test_openai_structured import FORMAT, SCHEMA

from pd_cluster.bench import prom
from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.sampling.structured import StructuredOutput

pytestmark = pytest.mark.slow  # starts processes

PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the",
           "Once upon a time, there was a little dog named Max who"]
JSON_PROMPT = "Lily went to the park with her mom."
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("standalone")
    draft = shallow_stories_draft(root / "draft")
    argv = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
            "--speculative-num-draft-tokens", "4"]
    with running_pd_serve(root / "manifest.json", argv) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), workers


@pytest.mark.timeout(400)
def test_1p1d_greedy_and_json_with_a_draft_model_equal_no_speculation(cluster):
    client, workers = cluster
    plain = LLM()
    offline = plain.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, want in zip(PROMPTS, offline):
        r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_dump()["token_ids"] == want.token_ids, prompt
        stream = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text, prompt
    spec = StructuredOutput(json_schema=SCHEMA, param="response_format")
    want = plain.generate(JSON_PROMPT, SamplingParams(max_tokens=200, temperature=0.0, structured_output=spec))[0]
    r = client.completions.create(model="stories260K", prompt=JSON_PROMPT, max_tokens=200, temperature=0,
                                  extra_body={"response_format": FORMAT, "return_token_ids": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text
    assert r.choices[0].model_dump()["token_ids"] == want.token_ids
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    for _ in range(6):  # sampled (no seed: a seeded request is not drafted)
        r = client.completions.create(model="stories260K", prompt=JSON_PROMPT, max_tokens=300, temperature=1.0,
                                      extra_body={"response_format": FORMAT})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    scrape = {role: prom.parse(httpx.get(u + "/metrics", timeout=10).text) for role, u in workers.items()}
    total = lambda role, name: prom.delta_sum({}, scrape[role], f"vllm:spec_decode_{name}_total")  # noqa: E731
    assert 0 < total("decode", "num_accepted_tokens") < total("decode", "num_draft_tokens")
    assert total("prefill", "num_drafts") == 0


@pytest.mark.timeout(120)
def test_1p1d_draft_pool_only_on_the_decode_and_every_page_back(cluster):
    _, workers = cluster
    loads = _wait_all_free(workers, 30)
    assert all(_all_free(v) for v in loads.values()), loads
    assert loads["decode"]["draft_num_total_pages"] > 0 and "draft_num_total_pages" not in loads["prefill"]
