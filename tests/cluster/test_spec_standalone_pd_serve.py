"""Acceptance: `pd-serve` 1P1D with a draft model (``--speculative-algorithm STANDALONE
--speculative-draft-model-path``; stories260K's first 4 layers, written by transformers): the draft runs on the
decode worker only, which computes the draft's KV of each prompt itself at the request's first decode step;
the prefill worker sends the target's KV as always. The real `openai` client gets the greedy tokens of the
engine without speculation, streamed or not, and with ``response_format`` json_schema the same valid JSON;
sampled JSON is always valid; the decode worker's ``vllm:spec_decode_*`` counters show drafts accepted and
rejected; every page comes back, the draft pool's included."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from cluster_util import running_pd_serve
from draft_models import shallow_stories_draft
from test_moe_pd_serve import _all_free, _wait_all_free
from test_openai_structured import FORMAT, SCHEMA
from test_spec_pd_serve import check_greedy_and_json, spec_totals

pytestmark = pytest.mark.slow  # starts processes

PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the",
           "Once upon a time, there was a little dog named Max who"]
JSON_PROMPT = "Lily went to the park with her mom."


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
    check_greedy_and_json(client, PROMPTS, JSON_PROMPT)
    for _ in range(6):  # sampled (no seed: a seeded request is not drafted)
        r = client.completions.create(model="stories260K", prompt=JSON_PROMPT, max_tokens=300, temperature=1.0,
                                      extra_body={"response_format": FORMAT})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    total = spec_totals(workers)
    assert 0 < total("decode", "num_accepted_tokens") < total("decode", "num_draft_tokens")
    assert total("prefill", "num_drafts") == 0


@pytest.mark.timeout(120)
def test_1p1d_draft_pool_only_on_the_decode_and_every_page_back(cluster):
    _, workers = cluster
    loads = _wait_all_free(workers, 30)
    assert all(_all_free(v) for v in loads.values()), loads
    assert loads["decode"]["draft_num_total_pages"] > 0 and "draft_num_total_pages" not in loads["prefill"]
