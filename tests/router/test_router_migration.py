"""Request migration and upstream timeouts, on token-level fake decode workers.

The fakes (``pd_fake --token-model``) generate each token id as a fixed
function of the context, as greedy decoding does, and speak vLLM's
``return_token_ids``. A decode worker is killed (SIGKILL) or frozen (SIGSTOP)
with streams in flight; every stream must end with exactly the text of an
undisturbed run, no token lost or repeated, within a stated bound.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from router_testkit import FakeWorker, RouterProc, metric_value, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKENS = 30
DECODE = ["--token-model", "--ttft-ms", "20", "--itl-ms", "40"]
ROUTER = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin",
          "--retry-initial-backoff-ms", "1", "--health-check-interval-secs", "0.3",
          "--health-check-timeout-secs", "0.5", "--health-failure-threshold", "2",
          "--health-success-threshold", "1"]


def stream_text(router: RouterProc, prompt: str, rid: str, chat: bool = False,
                on_token=None, **extra) -> tuple[str, list[dict]]:
    """Stream through the router with raw httpx; (text, every parsed event)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "stories260K", "max_tokens": TOKENS, "stream": True, **extra}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    text, events = [], []
    with httpx.stream("POST", router.url + path, json=body, timeout=60,
                      headers={"x-request-id": rid}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                if line == "data: [DONE]":
                    events.append({"done": True})
                continue
            event = json.loads(line[6:])
            events.append(event)
            assert "error" not in event, event
            for c in event["choices"]:
                piece = c["delta"].get("content") if chat else c["text"]
                if piece:
                    text.append(piece)
                    if on_token is not None:
                        on_token(len(text))
    assert events[-1] == {"done": True}
    return "".join(text), events


@pytest.fixture
def pd():
    with FakeWorker("prefill") as p, FakeWorker("decode", DECODE) as d0, \
            FakeWorker("decode", DECODE) as d1, \
            RouterProc(["--prefill", p.url, "--decode", d0.url, d1.url, *ROUTER,
                        "--upstream-idle-timeout-secs", "1"]) as router:
        yield router, p, d0, d1


def busy(decode: FakeWorker) -> int:
    return httpx.get(decode.url + "/get_load", timeout=5).json()["num_running_reqs"]


def run_streams(router: RouterProc, prompts: list[str], chat: list[bool], fault, min_tokens=5,
                **extra):
    """Start one stream per prompt; call ``fault()`` once every stream has ``min_tokens``."""
    results: dict[int, object] = {}
    counts = [0] * len(prompts)
    ready = threading.Event()

    def one(i: int) -> None:
        def seen(n: int) -> None:
            counts[i] = n
            if all(c >= min_tokens for c in counts):
                ready.set()
        try:
            results[i] = stream_text(router, prompts[i], f"mig-{i}", chat[i], seen, **extra)
        except BaseException as exc:  # reported by the assertion below
            results[i] = exc
            ready.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert ready.wait(30)
    fault()
    for t in threads:
        t.join(60)
    return [results[i] for i in range(len(prompts))]


def test_killed_decode_streams_continue_token_exact(pd):
    router, _, d0, d1 = pd
    prompts = [f"story {i} about a cat" for i in range(6)]
    chat = [i % 2 == 1 for i in range(6)]
    reference = [stream_text(router, p, f"ref-{i}", c)[0] for i, (p, c) in
                 enumerate(zip(prompts, chat))]
    assert all(len(r.split()) == TOKENS for r in reference)
    started = time.monotonic()
    results = run_streams(router, prompts, chat, lambda: d0.kill())
    assert time.monotonic() - started < 20
    for got, want in zip(results, reference):
        assert not isinstance(got, BaseException), got
        assert got[0] == want
        # token ids were asked for internally, never shown to this client
        assert all("token_ids" not in json.dumps(e) for e in got[1])
    m = router.metrics()
    assert metric_value(m, "pd_router_migrations_total") == 3
    continued = [e for e in d1.recent() if e.get("resume_token_ids")]
    assert len(continued) == 3 and all(e["return_token_ids"] for e in continued)
    # the same request again (same path, same prompt), continuing after what was relayed
    assert all(5 <= len(e["resume_token_ids"]) < TOKENS for e in continued)
    for e in continued:
        i = int(e["request_id"].split(":")[0].rsplit("-", 1)[1])
        assert e["path"] == ("/v1/chat/completions" if chat[i] else "/v1/completions")
        assert e["prompt"] == (None if chat[i] else prompts[i])
    assert sorted(e["request_id"].rsplit(":", 1)[1] for e in continued) == ["m1"] * 3
    assert busy(d1) == 0


def test_frozen_decode_stream_migrates_after_the_idle_timeout(pd):
    router, _, d0, d1 = pd
    prompts = ["a frozen tale", "another frozen tale"]
    reference = [stream_text(router, p, f"ref-f{i}")[0] for i, p in enumerate(prompts)]
    try:
        started = time.monotonic()
        results = run_streams(router, prompts, [False, False],
                              lambda: os.kill(d0.proc.pid, signal.SIGSTOP))
        took = time.monotonic() - started
        assert [r[0] for r in results] == reference
        assert took < 10  # 30 tokens at 40 ms plus one idle timeout (1 s), far below a hang
        m = router.metrics()
        assert metric_value(m, "pd_router_migrations_total", reason="idle_timeout") + \
            metric_value(m, "pd_router_migrations_total", reason="worker_dead") == 1
    finally:
        os.kill(d0.proc.pid, signal.SIGCONT)


def test_client_token_ids_and_usage_survive_a_migration(pd):
    router, _, d0, d1 = pd
    ref_text, ref_events = stream_text(router, "ids please", "ref-ids", return_token_ids=True,
                                       stream_options={"include_usage": True})
    ref_ids = [t for e in ref_events if "choices" in e for c in e["choices"]
               for t in c.get("token_ids", [])]
    assert len(ref_ids) == TOKENS
    got = run_streams(router, ["ids please"], [False],
                      lambda: (d0 if busy(d0) else d1).kill(), return_token_ids=True,
                      stream_options={"include_usage": True})[0]
    text, events = got
    assert text == ref_text
    ids = [t for e in events if "choices" in e for c in e["choices"]
           for t in c.get("token_ids", [])]
    assert ids == ref_ids
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage[-1]["completion_tokens"] == TOKENS
    assert usage[-1]["prompt_tokens"] == ref_events[-2]["usage"]["prompt_tokens"]
    assert len({e["id"] for e in events if "id" in e}) == 1


def test_non_streamed_request_on_a_frozen_worker_is_redispatched_once_it_shows_no_life(pd):
    router, _, d0, d1 = pd
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
    want = c.completions.create(model="stories260K", prompt="quiet story", max_tokens=TOKENS)
    os.kill(d0.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:  # round robin: one of the two goes to the frozen one
            texts = list(pool.map(lambda _: c.completions.create(
                model="stories260K", prompt="quiet story", max_tokens=TOKENS).choices[0].text,
                range(2)))
        # frozen is not dead (no connection was refused): the attempt fails once the worker showed no sign of
        # life (no byte, no probe answer, no progress) for the idle timeout (1 s), long before the first-byte
        # timeout (600 s), and is sent again
        assert time.monotonic() - started < 8
        assert texts == [want.choices[0].text] * 2
        wait_http(router.url + "/metrics", 5, ok=lambda r: metric_value(
            r.text, "pd_router_retries_total", reason="idle_timeout") == 1)
    finally:
        os.kill(d0.proc.pid, signal.SIGCONT)


def test_migration_limit_zero_ends_the_stream_with_an_error():
    with FakeWorker("prefill") as p, FakeWorker("decode", DECODE) as d0, \
            FakeWorker("decode", DECODE) as d1, \
            RouterProc(["--prefill", p.url, "--decode", d0.url, d1.url, *ROUTER,
                        "--migration-limit", "0"]) as router:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        got = []
        with pytest.raises(openai.APIError) as info:
            for chunk in c.completions.create(model="stories260K", prompt="x", max_tokens=TOKENS,
                                              stream=True):
                got.append(chunk.choices[0].text)
                if len(got) == 3:
                    (d0 if busy(d0) else d1).kill()
        assert "mid-stream" in str(info.value) and 3 <= len(got) < TOKENS
        assert metric_value(router.metrics(), "pd_router_migrations_total") == 0


def test_a_worker_that_refuses_return_token_ids_still_serves_the_stream():
    with FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "5", "--itl-ms", "1", "--num-tokens", "8",
                                  "--refuse-token-ids"]) as d, \
            RouterProc(["--prefill", p.url, "--decode", d.url, "--disable-retries"]) as router:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)
        text = "".join(ch.choices[0].text for ch in c.completions.create(
            model="stories260K", prompt="x", max_tokens=8, stream=True) if ch.choices)
        assert text == " Once upon a time there was little girl"
        assert [e["status"] for e in d.recent()] == [400, 200]
        # a client that asked for the field itself gets the worker's 400
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="stories260K", prompt="x", max_tokens=8, stream=True,
                                 extra_body={"return_token_ids": True})
        assert info.value.body["param"] == "return_token_ids"
