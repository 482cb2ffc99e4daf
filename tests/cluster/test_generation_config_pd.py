"""Acceptance: `pd-serve` 1P1D over a tiny random Llama whose ``generation_config.json`` adds an end-of-turn id to
``eos_token_id`` (one that greedy decoding reaches) and recommends ``temperature`` 0.6 and ``top_p`` 0.9. Through
the real `openai` client: greedy output stops at that id exactly where transformers' ``generate()`` stops, also
when it is the first token (sampled by the prefill worker); ``ignore_eos`` runs on; a request that sets no
temperature samples with the file's (seeded, it equals the offline engine's draw at 0.6 / 0.9), and one that
sets ``temperature: 1.0`` gets 1.0."""

from __future__ import annotations

import openai
import pytest
from cluster_util import running_pd_serve
from random_models import build_with_end_of_turn, hf_stop

from pd_cluster.engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_TOKENS = 24
NAME = "eot-llama"
SEED = 11


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, prompt ids, transformers' greedy tokens with no stop, the end-of-turn id, the folder)."""
    folder = tmp_path_factory.mktemp("eot")
    model, prompt, greedy, eot = build_with_end_of_turn(folder, MAX_TOKENS, temperature=0.6, top_p=0.9,
                                                        do_sample=True)
    assert hf_stop(model, prompt, MAX_TOKENS) == greedy[:greedy.index(eot) + 1]  # transformers' own stop
    argv = ["--model", str(folder), "--served-model-name", NAME]
    with running_pd_serve(tmp_path_factory.mktemp("pd") / "manifest.json", argv) as (url, manifest):
        assert sorted(w["role"] for w in manifest["workers"]) == ["decode", "prefill"]
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), prompt, greedy, eot, folder


def _ids(client, prompt, **kw):
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=extra, **kw)
    choice = r.choices[0].model_dump()
    return choice["token_ids"], choice["finish_reason"]


def test_greedy_stops_at_the_generation_configs_eos_as_transformers(served):
    client, prompt, greedy, eot, _ = served
    k = greedy.index(eot)
    assert _ids(client, prompt, temperature=0) == (greedy[:k + 1], "stop")  # on the decode worker
    # the end-of-turn id as the first token: sampled by the prefill worker, and the end on the decode worker
    assert _ids(client, prompt + greedy[:k], temperature=0) == ([eot], "stop")
    assert _ids(client, prompt, temperature=0, extra_body={"ignore_eos": True}) == (greedy, "length")
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=MAX_TOKENS, stream=True)
    finishes = [c.choices[0].finish_reason for c in chat if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])  # a streamed chat ends once, with OpenAI's finish_reason


def test_the_files_temperature_and_top_p_are_the_defaults_a_request_can_override(served):
    client, prompt, _, _, folder = served
    llm = LLM(model=str(folder), kv_cache_memory="16MiB")
    offline = {t: llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=t, top_p=p, seed=SEED))
               [0].outputs[0].token_ids for t, p in ((0.6, 0.9), (1.0, 1.0))}
    assert offline[0.6] != offline[1.0]  # the two settings draw different tokens from this seed
    assert _ids(client, prompt, seed=SEED)[0] == offline[0.6]
    assert _ids(client, prompt, seed=SEED, temperature=1.0, top_p=1.0)[0] == offline[1.0]
