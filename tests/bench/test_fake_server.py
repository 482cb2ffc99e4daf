"""The fake OpenAI worker: contract endpoints, exact delays, headers, fault injection."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.bench.fake_process import FakeServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def fake():
    with FakeServerProcess(["--ttft-ms", "50", "--itl-ms", "10", "--num-tokens", "20",
                            "--queue-ms", "5", "--transfer-ms", "15", "--role", "decode"], realtime=True) as f:
        yield f


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _worst_lateness(fake) -> float:
    """Seconds: the latest any of the fake's timers fired so far, plus 5 ms for the read of
    the clock that follows a timer (a preemption can fall between the two)."""
    return httpx.get(fake.url + "/debug/timers", timeout=10).json()["max_ms"] / 1e3 + 0.005


def test_streaming_completions_with_the_openai_client(fake):
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["stories260K"]
    stream = client.completions.create(model="stories260K", prompt="one two three", max_tokens=64,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_headers={"X-Request-Id": "timed-1"})
    text, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
        if chunk.choices and chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage:
            usage = chunk.usage
    assert len(text) == 20
    assert "".join(text).startswith(" Once upon a time there was little girl Once")
    assert reasons == ["stop"]  # --num-tokens 20 < max_tokens 64 acts as an EOS
    assert usage.completion_tokens == 20 and usage.prompt_tokens == 3
    # the fake's own record of when it wrote the tokens: each against its own deadline
    # Never early; late by no more than the fake's own worst timer (a loaded machine fires
    # timers late, and only that lateness may show). The last token at 50 + 19 * 10 ms within
    # one timer's lateness shows the deadlines are absolute: sleeping 10 ms after each token
    # would add up all 20 timers' lateness.
    entry = next(e for e in httpx.get(fake.url + "/debug/requests").json() if e["request_id"] == "timed-1")
    late = _worst_lateness(fake)
    first, last = entry["first_token"] - entry["arrival"], entry["last_token"] - entry["arrival"]
    assert 0.050 <= first <= 0.050 + late, (first, late)
    assert 0.050 + 19 * 0.010 <= last <= 0.050 + 19 * 0.010 + late, (last, late)


def test_non_streaming_chat_honours_max_tokens_and_echoes_request_id(fake):
    r = httpx.post(fake.url + "/v1/chat/completions", timeout=10,
                   headers={"X-Request-Id": "req-42", "X-PD-Prefill-Url": "http://10.0.0.7:9000"},
                   json={"model": "stories260K", "max_tokens": 3,
                         "messages": [{"role": "user", "content": "a b"}]})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-42"
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " Once upon a"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    recent = httpx.get(fake.url + "/debug/requests", timeout=10).json()
    mine = [e for e in recent if e["request_id"] == "req-42"]
    assert mine[0]["headers"]["x-pd-prefill-url"] == "http://10.0.0.7:9000"


def test_contract_endpoints(fake):
    assert httpx.get(fake.url + "/health").json() == {"status": "ok"}
    info = httpx.get(fake.url + "/server_info").json()
    assert info["role"] == "decode" and info["served_model_name"] == "stories260K"
    load = httpx.get(fake.url + "/get_load").json()
    assert load["num_total_pages"] == 65536 // 16 and load["num_running_reqs"] == 0
    models = httpx.get(fake.url + "/v1/models").json()
    assert models["data"][0]["id"] == "stories260K"


def test_errors_are_openai_shaped(fake):
    r = httpx.post(fake.url + "/v1/completions", content=b"{nope", timeout=10)
    err = r.json()["error"]
    assert r.status_code == 400 and (err["type"], err["code"]) == ("invalid_request_error", "invalid_json")
    r = httpx.post(fake.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=10)
    err = r.json()["error"]
    assert r.status_code == 404 and "other" in err["message"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")


def test_metrics_measure_the_emulated_phases(fake):
    before = _samples(httpx.get(fake.url + "/metrics").text)
    n = 4
    for _ in range(n):
        httpx.post(fake.url + "/v1/completions", json={"prompt": "w " * 32, "max_tokens": 5}, timeout=10)
    after = _samples(httpx.get(fake.url + "/metrics").text)

    def delta(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    assert delta("pd:request_queue_time_seconds_count") == n
    mean = lambda base: delta(base + "_sum") / delta(base + "_count")  # noqa: E731
    # each phase runs between two deadlines, so it is off by at most one timer's lateness
    late = _worst_lateness(fake)
    assert mean("pd:request_queue_time_seconds") == pytest.approx(0.005, abs=late)
    assert mean("pd:request_prefill_time_seconds") == pytest.approx(0.030, abs=late)
    assert mean("pd:request_transfer_time_seconds") == pytest.approx(0.015, abs=late)
    assert mean("pd:request_decode_time_seconds") == pytest.approx(0.040, abs=late)
    assert mean("pd:time_to_first_token_seconds") == pytest.approx(0.050, abs=late)
    assert delta("pd:kv_transfer_bytes_total") == n * 32 * 1024
    assert delta("pd:prompt_tokens_total") == n * 32
    assert delta("pd:generation_tokens_total") == n * 5


def test_fail_every_injects_the_status():
    with FakeServerProcess(["--ttft-ms", "0", "--itl-ms", "0", "--fail-every", "3", "--fail-status", "503"]) as f:
        codes = [httpx.post(f.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
                 for _ in range(6)]
    assert codes == [200, 200, 503, 200, 200, 503]


def test_die_after_exits_mid_stream():
    with FakeServerProcess(["--ttft-ms", "0", "--itl-ms", "5", "--num-tokens", "10", "--die-after", "2"]) as f:
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        ok = httpx.post(f.url + "/v1/completions", json=body, timeout=10).text
        assert ok.endswith("data: [DONE]\n\n")
        events = []
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("POST", f.url + "/v1/completions", json=body, timeout=10) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
        assert 1 <= len(events) < 10
        f.proc.wait(timeout=10)
        assert not f.alive


def test_prefill_role_serves_no_openai_api():
    with FakeServerProcess(["--role", "prefill"]) as f:
        r = httpx.post(f.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 404
        assert httpx.get(f.url + "/server_info").json()["role"] == "prefill"


def test_debug_timers_count_every_emulated_delay():
    """Queue, prefill and transfer phases plus one deadline per token: 3 + 4 timers per request."""
    with FakeServerProcess(["--ttft-ms", "30", "--itl-ms", "5", "--num-tokens", "4",
                            "--queue-ms", "5", "--transfer-ms", "10"]) as f:
        assert httpx.get(f.url + "/debug/timers").json()["count"] == 0
        for _ in range(2):
            r = httpx.post(f.url + "/v1/completions", json={"model": "stories260K", "prompt": "a b", "max_tokens": 8})
            assert r.json()["usage"]["completion_tokens"] == 4
        t = httpx.get(f.url + "/debug/timers").json()
    assert t["count"] == 2 * (3 + 4)
    assert 0.0 <= t["p50_ms"] <= t["p99_ms"] <= t["max_ms"] < 1000.0
