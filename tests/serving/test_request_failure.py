"""A request the engine fails alone (finish_reason ``error``, e.g. its logits could not be prepared) ends with an
OpenAI error on its own connection, while the other requests of the batch finish with their exact text."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from worker_kit import PROMPTS, running_worker  # noqa: E402

BODY = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}


def _stream(url: str, prompt: str, out: dict) -> None:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "prompt": prompt, "stream": True},
                      timeout=60) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out["events"] = events


def _text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and "choices" in e)


def _fail_one_running(w, exclude: set[str]) -> str:
    """Fail, in the engine thread, one running request that is not in `exclude`; return its engine id."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ids = [rid for rid, r in list(w.engine.requests.items()) if rid not in exclude and r.output_token_ids]
        if ids:
            w.loop.call_soon(lambda e: e.fail_request(ids[0], "injected failure"))
            return ids[0]
        time.sleep(0.005)
    raise TimeoutError("no running request to fail")


def test_a_failed_stream_gets_an_error_event_and_the_other_stream_its_exact_text():
    with running_worker() as w:
        solo = httpx.post(w.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[1]}, timeout=60).json()
        expected = solo["choices"][0]["text"]
        outs = [{}, {}]
        t0 = threading.Thread(target=_stream, args=(w.url, PROMPTS[0], outs[0]), daemon=True)
        t0.start()
        failed_id = _fail_one_running(w, set())
        t1 = threading.Thread(target=_stream, args=(w.url, PROMPTS[1], outs[1]), daemon=True)
        t1.start()
        t0.join(60)
        t1.join(60)
        assert not t0.is_alive() and not t1.is_alive()
        events = outs[0]["events"]
        assert outs[0]["status"] == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "request_failed" and "injected failure" in error["message"]
        assert error["type"] == "server_error"
        assert outs[1]["status"] == 200 and _text(outs[1]["events"]) == expected
        assert failed_id not in w.engine.requests
        load = w.engine.load()
        assert load["num_running_reqs"] == 0 and load["num_free_pages"] == load["num_total_pages"]


def test_a_failed_non_streamed_request_is_a_500_in_openai_format():
    with running_worker() as w:
        out: dict = {}

        def post() -> None:
            r = httpx.post(w.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[2]}, timeout=60)
            out["status"], out["body"] = r.status_code, r.json()

        t = threading.Thread(target=post, daemon=True)
        t.start()
        _fail_one_running(w, set())
        t.join(60)
        assert out["status"] == 500
        assert out["body"]["error"]["code"] == "request_failed"
        assert "injected failure" in out["body"]["error"]["message"]
        ok = httpx.post(w.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[2], "max_tokens": 8}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
