"""Acceptance: `pd-serve` at 1P1D answers the real `openai` client with the reference greedy text (its decode
worker with overlap scheduling, as on CUDA), and real clients of the prompt's side: lm-eval's loglikelihood
(`local-completions`, several prompts per request, prompt logprobs computed by the prefill worker) equal to
transformers', and LangChain's `OpenAI.batch`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from cluster_util import PROMPTS, running_pd_serve
from engine_reference import hf_greedy

from pd_cluster.bench import prom
from pd_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pd_serve(tmp_path_factory):
    # the decode worker overlaps its steps as on CUDA (the prefill role never does); the texts must still
    # equal the offline engine's, which does not overlap
    with running_pd_serve(tmp_path_factory.mktemp("pd") / "manifest.json", ["--enable-overlap-schedule"],
                          with_process=True) as served:
        yield served


@pytest.fixture(scope="module")
def offline():
    llm = LLM()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {p: o for p, o in zip(PROMPTS, outs)}


@pytest.mark.timeout(600)
def test_default_cluster_is_1p1d(pd_serve):
    _, manifest, _ = pd_serve
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


# ---- real clients of the prompt's side: lm-eval's loglikelihood, LangChain's batch, prompt logprobs in PD ------
MC_DOCS = [
    {"context": "Once upon a time, there was a little", "choices": [" girl", " car", " moon"], "label": 0},
    {"context": "Lily went to the park with her", "choices": [" mom", " spoon", " rain"], "label": 0},
    {"context": "The dog was very", "choices": [" happy", " blue", " under"], "label": 0},
    {"context": "Tom liked to play with his", "choices": [" ball", " sky", " was"], "label": 0},
    {"context": "One day, the sun was", "choices": [" hot", " shining", " sad"], "label": 1},
]
MC_TASK = """task: pd_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def _hf_loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
    """transformers' log P(continuation | context) and greediness, on the token ids lm-eval's API models send
    (`TemplateAPI._encode_pair`: trailing spaces move to the continuation; whole and context encoded without
    special tokens; the continuation is the whole's tail)."""
    import torch
    from engine_reference import hf_model

    model, tok = hf_model()
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits.float().log_softmax(-1)[0]
    rows = range(len(ctx) - 1, len(whole) - 1)
    return (sum(logp[i, whole[i + 1]].item() for i in rows),
            all(int(logp[i].argmax()) == whole[i + 1] for i in rows))


@pytest.mark.timeout(600)
def test_lm_eval_loglikelihood_batch_4_equals_transformers(pd_serve, tmp_path, monkeypatch):
    import json

    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "pd_tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["pd_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": pd_serve[0] + "/v1/completions", "model": "stories260K", "max_retries": 1,
                    "tokenizer_backend": "remote"},  # /tokenizer_info and /tokenize through the router
        batch_size=4, log_samples=True)
    samples = out["samples"]["pd_tiny_mc"]
    assert len(samples) == len(MC_DOCS)
    for s in samples:
        doc = s["doc"]
        for (context, continuation), (resp,) in zip(s["arguments"], s["resps"]):
            ll, greedy = resp
            ref_ll, ref_greedy = _hf_loglikelihood(context, continuation)
            assert context == doc["context"] and abs(ll - ref_ll) < 1e-4, (context, continuation, ll, ref_ll)
            assert greedy == ref_greedy
    assert 0.0 <= out["results"]["pd_tiny_mc"]["acc,none"] <= 1.0


@pytest.mark.timeout(600)
def test_prompt_logprobs_come_from_the_prefill_worker_exact(pd_serve):
    from engine_reference import hf_model, hf_prompt_logprobs

    _, tok = hf_model()
    client = openai.OpenAI(base_url=pd_serve[0] + "/v1", api_key="unused", max_retries=0)
    long_prompt = " ".join(PROMPTS) * 3  # a few hundred tokens: the notification carries every position's top-5
    ids = tok(long_prompt).input_ids
    assert 300 < len(ids) < 500
    r = client.completions.create(model="stories260K", prompt=long_prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 5})
    plp = r.choices[0].model_dump()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    ref = hf_prompt_logprobs(ids)
    assert max(abs(e[str(t)]["logprob"] - v) for t, e, v in zip(ids[1:], plp[1:], ref)) < 1e-4
    assert all(len(e) >= 5 for e in plp[1:])
    # the same prompt again: the prefix cache must not skip the positions whose logprobs are asked
    again = client.completions.create(model="stories260K", prompt=long_prompt, max_tokens=0, echo=True,
                                      logprobs=1)
    got = again.choices[0].logprobs.token_logprobs
    assert got[0] is None and max(abs(a - b) for a, b in zip(got[1:], ref)) < 1e-4
    # streamed: the first chunk echoes the prompt with its logprobs; chat answers prompt_logprobs at the top
    first = next(iter(client.completions.create(model="stories260K", prompt=long_prompt, max_tokens=3, echo=True,
                                                logprobs=1, temperature=0, stream=True)))
    assert first.choices[0].text.startswith(long_prompt)
    streamed = first.choices[0].logprobs.token_logprobs
    assert max(abs(a - b) for a, b in zip(streamed[1:len(ids)], ref)) < 1e-4
    chat = [c.model_dump() for c in client.chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=3, temperature=0,
        stream=True, extra_body={"prompt_logprobs": 0})]
    chat_ids = tok("<s>" + PROMPTS[1], add_special_tokens=False).input_ids
    plp = chat[0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(chat_ids)
    assert max(abs(e[str(t)]["logprob"] - v) for t, e, v in zip(chat_ids[1:], plp[1:],
                                                                hf_prompt_logprobs(chat_ids))) < 1e-4


@pytest.mark.timeout(600)
def test_langchain_openai_batch(pd_serve, offline):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.OpenAI(base_url=pd_serve[0] + "/v1", api_key="unused", model="stories260K", max_tokens=MAX_TOKENS,
                    temperature=0, max_retries=0)
    prompts = PROMPTS[:4]
    texts = llm.batch(prompts)  # one /v1/completions request with the four prompts
    assert texts == [offline[p].text for p in prompts]


@pytest.mark.timeout(300)
def test_each_request_counts_once_summed_over_the_workers(pd_serve):
    """What vLLM's dashboards sum over every pod: each PD request once in request_success (label finished_reason)
    and in the per-request token histograms, each prompt once in the prefix-cache lookups."""
    url, manifest, _ = pd_serve
    workers = {w["role"]: w["url"] for w in manifest["workers"]}
    scrape = lambda: {role: prom.parse(httpx.get(u + "/metrics", timeout=10).text) for role, u in workers.items()}
    before = scrape()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    usages, max_tokens = [], [MAX_TOKENS, 7, 12, 25]
    for prompt, n in zip(PROMPTS, max_tokens):
        usages.append(client.completions.create(model="stories260K", prompt=prompt, max_tokens=n,
                                                temperature=0).usage)
    n = len(usages)
    # The prefill counts its /prefill job when the job's HTTP answer is ready; the decode may already have
    # received the KV, finished the request and answered the client before that: the counters agree within moments.
    settle = time.monotonic() + 10
    while True:
        after = scrape()
        prefilled = prom.delta_sum(before["prefill"], after["prefill"], "pd:prefill_requests_total")
        if prefilled >= n or time.monotonic() > settle:
            break
        time.sleep(0.1)
    total = lambda name: sum(prom.delta_sum(before[r], after[r], name) for r in workers)  # noqa: E731
    assert total("vllm:request_success_total") == n
    assert total("pd:request_success_total") == n
    assert prefilled == n
    by_reason = prom.delta_by_label(before["decode"], after["decode"], "vllm:request_success_total",
                                    "finished_reason")
    assert sum(by_reason.values()) == n and set(by_reason) <= {"length", "stop"}
    assert total("vllm:request_prompt_tokens_count") == n
    assert total("vllm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert total("vllm:request_generation_tokens_sum") == sum(u.completion_tokens for u in usages)
    assert total("vllm:request_max_num_generation_tokens_sum") == sum(max_tokens)
    assert total("vllm:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert total("vllm:prompt_tokens_total") <= sum(u.prompt_tokens for u in usages)  # cached tokens not computed
    for role, sc in after.items():
        info = [dict(labels) for (name, labels) in sc if name == "vllm:cache_config_info"]
        assert len(info) == 1 and info[0]["block_size"] == "64" and info[0]["model_name"] == "stories260K", role


@pytest.mark.timeout(300)
def test_what_the_readme_says_port_8000_serves(pd_serve):
    """README: the router's port serves the OpenAI API, /tokenize, /detokenize, /version, /openapi.json, /health,
    /readiness and its own metrics (pd_router_*, labelled model_name); the vllm:* and pd:* metrics are the
    workers'."""
    url, manifest, _ = pd_serve
    worker = manifest["workers"][0]["url"]
    with httpx.Client(timeout=10) as c:
        assert c.get(url + "/version").json() == c.get(worker + "/version").json()
        assert c.get(url + "/v1/models").json()["data"][0]["id"] == "stories260K"
        ids = c.post(url + "/tokenize", json={"model": "stories260K", "prompt": "Once upon a time"}).json()["tokens"]
        assert c.post(url + "/detokenize", json={"model": "stories260K", "tokens": ids}).json()["prompt"] \
            .endswith("Once upon a time")
        assert c.get(url + "/openapi.json").json()["openapi"]
        assert c.get(url + "/health").status_code == 200 and c.get(url + "/readiness").status_code == 200
        text = c.get(url + "/metrics").text
        assert not any(line.endswith("_created") or "_created{" in line for line in text.splitlines())
        samples = [line for line in text.splitlines() if line.startswith("pd_router_")]
        assert samples and all('model_name="stories260K"' in line for line in samples)
        router = prom.parse(text)
        assert router[("pd_router_requests_total", (("endpoint", "completions"), ("model_name", "stories260K"),
                                                    ("status", "200")))] >= 1
        assert "vllm:" not in text
        readme = (Path(__file__).parents[2] / "README.md").read_text()
        for claim in ("`/version`", "`pd_router_*`", "workers' ports"):
            assert claim in readme

@pytest.mark.timeout(300)
def test_without_an_api_key_decode_contacts_only_the_prefill_workers_it_was_told_about(pd_serve, offline):
    _, manifest, _ = pd_serve
    (prefill,) = [w["url"] for w in manifest["workers"] if w["role"] == "prefill"]
    (decode,) = [w["url"] for w in manifest["workers"] if w["role"] == "decode"]
    prompt = PROMPTS[0]
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(timeout=30) as c:
        for evil in ("http://127.0.0.1:1", "http://169.254.169.254/latest", prefill + "/../other"):
            r = c.post(decode + "/v1/completions", json=body, headers={"X-PD-Prefill-Url": evil})
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "prefill_url_not_allowed"
        # a prefill worker of the cluster (pd-serve passed --prefill-urls) is accepted, without a key
        r = c.post(decode + "/v1/completions", json=body, headers={"X-PD-Prefill-Url": prefill})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline[prompt].text

@pytest.mark.timeout(300)
def test_ctrl_c_drains_a_stream_in_flight_before_the_workers_stop(pd_serve, offline):
    """Last in the module: it stops the cluster. A stream started before Ctrl-C ends with the full reference text;
    meanwhile the router refuses new requests and the workers keep serving. The decode worker is frozen (SIGSTOP)
    across the signal, so the stream is surely in flight when it arrives."""
    url, manifest, proc = pd_serve
    (prefill,) = [w for w in manifest["workers"] if w["role"] == "prefill"]
    (decode,) = [w for w in manifest["workers"] if w["role"] == "decode"]
    prompt = PROMPTS[3]
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    pieces, finish = [], None
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        os.kill(decode["pid"], signal.SIGSTOP)
        try:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            deadline = time.monotonic() + 10
            while _router_takes_requests(url):
                assert time.monotonic() < deadline, "the router still takes new requests 10 s after Ctrl-C"
                time.sleep(0.1)
            time.sleep(0.5)
            assert proc.poll() is None
            assert httpx.get(prefill["url"] + "/health", timeout=5).status_code == 200  # not stopped yet
        finally:
            os.kill(decode["pid"], signal.SIGCONT)
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["text"])
            finish = choice["finish_reason"] or finish
    assert "".join(pieces) == offline[prompt].text
    assert finish == offline[prompt].finish_reason
    assert proc.wait(60) == 0


def _router_takes_requests(url: str) -> bool:
    """False once the router drains: its /health is 503, or it stopped accepting connections."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
