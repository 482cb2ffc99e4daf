"""Acceptance: `pd-serve` 1P1D with NGRAM speculative decoding (``--speculative-algorithm NGRAM
--speculative-num-draft-tokens 4``, passed to both workers): the decode worker drafts from each request's own
tokens and verifies them; the real `openai` client gets the same greedy tokens as the engine without speculation,
streamed or not, and with ``response_format`` json_schema the same valid JSON; the decode worker's
``vllm:spec_decode_*`` counters show drafts accepted and rejected (the prefill worker drafts nothing); every page
comes back on both sides."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from cluster_util import running_pd_serve
from test_moe_pd_serve import _wait_all_free
from test_openai_structured import FORMAT, SCHEMA

from pd_cluster.bench import prom
from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.sampling.structured import StructuredOutput

PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the",
           "one two three four five one two three four five one two three",
           "Once upon a time, there was a little dog named Max who"]
MAX_TOKENS = 32


def check_greedy_and_json(client: openai.OpenAI, prompts: list[str], json_prompt: str) -> None:
    """Greedy completions of `prompts` (streamed and not) and a greedy json_schema completion of `json_prompt`
    equal the engine's output without speculation, token for token; the JSON is valid."""
    plain = LLM()
    offline = plain.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, want in zip(prompts, offline):
        r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_dump()["token_ids"] == want.token_ids, prompt
        stream = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text, prompt
    spec = StructuredOutput(json_schema=SCHEMA, param="response_format")
    want = plain.generate(json_prompt, SamplingParams(max_tokens=200, temperature=0.0, structured_output=spec))[0]
    r = client.completions.create(model="stories260K", prompt=json_prompt, max_tokens=200, temperature=0,
                                  extra_body={"response_format": FORMAT, "return_token_ids": True})
    assert r.choices[0].model_dump()["token_ids"] == want.token_ids and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def spec_totals(workers: dict[str, str]):
    """A function (role, counter) -> the worker's ``vllm:spec_decode_<counter>_total``."""
    scrape = {role: prom.parse(httpx.get(u + "/metrics", timeout=10).text) for role, u in workers.items()}
    return lambda role, name: prom.delta_sum({}, scrape[role], f"vllm:spec_decode_{name}_total")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_1p1d_with_ngram_speculation_equals_greedy_without(tmp_path):
    argv = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
    with running_pd_serve(tmp_path / "manifest.json", argv) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        check_greedy_and_json(client, PROMPTS, PROMPTS[2])
        total = spec_totals(workers)
        assert 0 < total("decode", "num_accepted_tokens") < total("decode", "num_draft_tokens")
        assert total("decode", "num_drafts") > 0 and total("prefill", "num_drafts") == 0
        loads = _wait_all_free(workers, 30)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
