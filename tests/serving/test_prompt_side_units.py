"""The prompt's side of `/v1/completions` over a scripted `PromptSource` (no engine): several prompts with
``best_of`` ranked per prompt, usage summed per prompt, ``max_tokens`` 0, vLLM's ``prompt_logprobs`` shape, and
a clear 502 when the prompt logprobs do not come (a prefill worker that does not send them)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.outputs import RequestDelta
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.openai_serving import OpenAIServing, PromptSource


class ScriptedSource(PromptSource):
    """Answers every request with `script(prompt_ids, params)` = [(token, logprob)] and, when asked, prompt
    logprobs: position i's next token gets logprob -i - 1, rank i + 1 (or none at all: `send_prompt_lps`)."""

    def __init__(self, script, send_prompt_lps: bool = True) -> None:
        self.script = script
        self.send_prompt_lps = send_prompt_lps
        self.started: list[tuple[list[int], object]] = []
        self.aborted: list[str] = []

    async def start(self, request_id, prompt_ids, params, headers, resumed=None):
        self.started.append((prompt_ids, params))
        q: asyncio.Queue = asyncio.Queue()
        plps = None
        if params.prompt_logprobs is not None and self.send_prompt_lps:
            plps = [(-float(i + 1), [(7, -0.5), (8, -1.5)][:params.prompt_logprobs], i + 1)
                    for i in range(len(prompt_ids) - 1)]
        toks = self.script(prompt_ids, params)
        for k, (tok, lp) in enumerate(toks):
            last = k == len(toks) - 1
            q.put_nowait(RequestDelta(request_id, [tok], f"<{tok}>", [(lp, [(tok, lp)])] if params.logprobs is not None
                                      else None, last, "length" if last else None, None, len(prompt_ids), k + 1,
                                      prompt_logprobs=plps if k == 0 else None))
        return q

    def abort(self, request_id):
        self.aborted.append(request_id)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def _client(tokenizer, source) -> TestClient:
    serving = OpenAIServing(source, tokenizer, "m", 512, WorkerMetrics(CollectorRegistry(), "decode", "m"))
    return TestClient(Starlette(routes=[Route("/v1/completions", serving.completions, methods=["POST"])]))


def test_several_prompts_rank_best_of_per_prompt_and_sum_usage(tokenizer):
    # the sequence's logprob depends on its seed: best_of picks per prompt, indices stay prompt_i * n + j
    source = ScriptedSource(lambda ids, p: [(300 + p.seed, -float(p.seed % 3))] * 2)
    with _client(tokenizer, source) as c:
        r = c.post("/v1/completions", json={"prompt": [[1, 400, 300], [1, 200]], "n": 2, "best_of": 3, "seed": 0,
                                            "max_tokens": 2, "temperature": 1.0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    # seeds 0, 1, 2 per prompt: logprobs 0, -1, -2: the best two are seeds 0 and 1, best first
    assert [ch["text"] for ch in body["choices"]] == ["<300><300>", "<301><301>"] * 2
    assert body["usage"]["prompt_tokens"] == 3 + 2  # each prompt once
    assert body["usage"]["completion_tokens"] == 2 * 3 * 2  # every generated sequence
    assert [ids for ids, _ in source.started] == [[1, 400, 300]] * 3 + [[1, 200]] * 3


def test_echo_max_tokens_0_and_vllm_prompt_logprobs(tokenizer):
    source = ScriptedSource(lambda ids, p: [(5, -0.25)])
    with _client(tokenizer, source) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 400, 300], "max_tokens": 0, "echo": True, "logprobs": 1,
                                            "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    (ch,) = r.json()["choices"]
    assert source.started[0][1].max_tokens == 1 and source.started[0][1].prompt_logprobs == 2
    assert ch["text"] == tokenizer.decode([1, 400, 300], skip_special_tokens=True)  # the prompt alone
    assert ch["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert ch["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]  # the prompt's, not the dropped token's
    assert ch["logprobs"]["top_logprobs"][0] is None and len(ch["logprobs"]["top_logprobs"][1]) == 1
    assert ch["prompt_logprobs"] == [None] + [
        {str(tok): {"logprob": -float(i + 1), "rank": i + 1, "decoded_token": tokenizer.decode([tok])},
         **{k: v for k, v in {"7": {"logprob": -0.5, "rank": 1, "decoded_token": tokenizer.decode([7])},
                              "8": {"logprob": -1.5, "rank": 2, "decoded_token": tokenizer.decode([8])}}.items()
            if k != str(tok)}}
        for i, tok in enumerate([400, 300])]


def test_missing_prompt_logprobs_are_a_clear_502(tokenizer):
    source = ScriptedSource(lambda ids, p: [(5, -0.25)], send_prompt_lps=False)
    with _client(tokenizer, source) as c:
        r = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 1, "echo": True,
                                            "logprobs": 1})
    assert r.status_code == 502 and r.json()["error"]["code"] == "prompt_logprobs_unavailable"
    assert source.aborted
