"""Acceptance: `pd-serve` at 1P1D answers the real `openai` client with the reference greedy text (its decode
worker with overlap scheduling, as on CUDA)."""

from __future__ import annotations

import openai
import pytest
from cluster_util import PROMPTS, running_pd_serve
from engine_reference import hf_greedy

from pd_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pd_serve(tmp_path_factory):
    # the decode worker overlaps its steps as on CUDA (the prefill role never does); the texts must still
    # equal the offline engine's, which does not overlap
    with running_pd_serve(tmp_path_factory.mktemp("pd") / "manifest.json", ["--enable-overlap-schedule"]) as served:
        yield served


@pytest.fixture(scope="module")
def offline():
    llm = LLM()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {p: o for p, o in zip(PROMPTS, outs)}


@pytest.mark.timeout(600)
def test_default_cluster_is_1p1d(pd_serve):
    _, manifest = pd_serve
    assert sorted(w["role"] for w in manifest["workers"]) == ["decode", "prefill"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_offline_and_transformers(pd_serve, offline, stream):
    client = openai.OpenAI(base_url=pd_serve[0] + "/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        if stream:
            chunks = list(client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert chunks[-1].choices[0].finish_reason == offline[prompt].finish_reason
        else:
            r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            text = r.choices[0].text
            assert r.usage.completion_tokens == len(offline[prompt].token_ids)
        assert text == offline[prompt].text, prompt
        _assert_transformers_agrees(prompt, text, offline[prompt])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_offline(pd_serve, offline, stream):
    client = openai.OpenAI(base_url=pd_serve[0] + "/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS[:3]:
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = list(client.chat.completions.create(model="stories260K", messages=messages,
                                                         max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage.completion_tokens == len(offline[prompt].token_ids)
        else:
            text = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0).choices[0].message.content
        # the embedded model's chat template is "<s>" + the user's text: the same prompt ids
        assert text == offline[prompt].text, prompt


def _assert_transformers_agrees(prompt: str, text: str, out) -> None:
    """The served text is transformers' greedy continuation (up to an EOS the engine stopped at)."""
    from engine_reference import hf_model

    _, tok = hf_model()
    n = len(out.token_ids) - (1 if out.finish_reason == "stop" else 0)
    hf_ids = list(hf_greedy(prompt, MAX_TOKENS, "fp32"))[:n]
    assert list(out.token_ids[:n]) == hf_ids
    assert prompt + text == tok.decode(tok(prompt).input_ids + hf_ids, skip_special_tokens=True)
