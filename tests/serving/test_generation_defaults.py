"""The generation config's defaults as the engine receives them from `/v1/completions` and `/v1/chat/completions`
(a recording `PromptSource`, no engine): fields a request does not set take the defaults, fields it sets (even
to OpenAI's own default) win, ``max_new_tokens`` is the default ``max_tokens`` (within the context) and, from a
``--generation-config`` folder, an upper bound."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.model.generation_config import GenerationDefaults
from pd_cluster.engine.outputs import RequestDelta
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.openai_serving import OpenAIServing, PromptSource
from pd_cluster.serving.protocol import NO_DEFAULTS

CONTEXT = 512
SAMPLING = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
AUTO = GenerationDefaults("auto", "generation_config.json", (2,), dict(SAMPLING, max_tokens=100))
FOLDER = GenerationDefaults("/cfg", "/cfg/generation_config.json", (2,), {"max_tokens": 100}, max_tokens_cap=True)
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


class RecordingSource(PromptSource):
    """Records the params of every request the server starts and answers one token."""

    def __init__(self) -> None:
        self.params = []

    async def start(self, request_id, prompt_ids, params, headers, resumed=None):
        self.params.append(params)
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(RequestDelta(request_id, [300], "x", None, True, "stop", None, len(prompt_ids), 1))
        return q

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def _received(tokenizer, generation, path, body) -> dict:
    """The sampling fields the engine receives for one request."""
    source = RecordingSource()
    serving = OpenAIServing(source, tokenizer, "m", CONTEXT, WorkerMetrics(CollectorRegistry(), "decode", "m"),
                            generation=generation)
    routes = [Route("/v1/completions", serving.completions, methods=["POST"]),
              Route("/v1/chat/completions", serving.chat_completions, methods=["POST"])]
    with TestClient(Starlette(routes=routes)) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    (params,) = source.params
    return {f: getattr(params, f) for f in FIELDS}


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
COMPLETION = ("/v1/completions", {"prompt": "Once upon a time"})


@pytest.mark.parametrize("path,body", [CHAT, COMPLETION])
def test_unset_fields_take_the_generation_configs_defaults(tokenizer, path, body):
    got = _received(tokenizer, AUTO, path, body)
    # completions keep OpenAI's max_tokens default of 16 (as vLLM: its field has that default); chat has none
    assert got == dict(SAMPLING, max_tokens=100 if path == CHAT[0] else 16)


@pytest.mark.parametrize("path,body", [CHAT, COMPLETION])
def test_fields_the_request_sets_win_even_at_openais_defaults(tokenizer, path, body):
    own = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 7}
    assert _received(tokenizer, AUTO, path, dict(body, **own)) == own


def test_null_is_unset(tokenizer):
    body = dict(COMPLETION[1], temperature=None, top_k=None, max_tokens=None)
    assert _received(tokenizer, AUTO, COMPLETION[0], body) == dict(SAMPLING, max_tokens=100)


def test_without_a_generation_config_the_engine_defaults_stay(tokenizer):
    got = _received(tokenizer, NO_DEFAULTS, CHAT[0], CHAT[1])
    assert got == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                   "max_tokens": None}  # None: up to the context length (the engine fills it)


def test_default_max_tokens_fits_what_the_prompt_leaves(tokenizer):
    prompt = [1] + [300] * (CONTEXT - 42)  # 41 tokens of room
    got = _received(tokenizer, AUTO, COMPLETION[0], {"prompt": prompt, "max_tokens": None})
    assert got["max_tokens"] == 41  # not 100: the request never asked for more than fits


def test_a_generation_config_folder_bounds_every_max_tokens(tokenizer):
    assert _received(tokenizer, FOLDER, CHAT[0], dict(CHAT[1], max_tokens=500))["max_tokens"] == 100
    assert _received(tokenizer, FOLDER, CHAT[0], dict(CHAT[1], max_tokens=40))["max_tokens"] == 40
    assert _received(tokenizer, AUTO, CHAT[0], dict(CHAT[1], max_tokens=300))["max_tokens"] == 300  # auto: no bound
