"""An engine loop that dies fails every request in flight with a clear error, then the worker exits non-zero
(issue 12: "an engine loop that dies takes its process with it")."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bad_input_cases import assert_openai_error  # noqa: E402
from worker_kit import PROMPTS, running_worker  # noqa: E402

from pd_cluster.launch.cluster import free_port  # noqa: E402
from pd_cluster.serving.worker_app import ENGINE_DEAD_EXIT_CODE  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)


def _stream_events(url: str, prompt: str, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as e:
        out["exception"] = e
    out["events"] = events


def test_in_flight_requests_fail_clearly_when_the_engine_loop_dies():
    with running_worker() as w:
        outs = [{} for _ in range(3)]
        threads = [threading.Thread(target=_stream_events, args=(w.url, p, o), daemon=True)
                   for p, o in zip(PROMPTS, outs)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while w.engine.load()["num_running_reqs"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        collected: dict = {}
        collect = threading.Thread(target=lambda: collected.update(r=httpx.post(
            w.url + "/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 400, "ignore_eos": True},
            timeout=60)), daemon=True)
        collect.start()
        time.sleep(0.2)

        def boom():
            raise RuntimeError("injected engine failure")

        w.engine.step = boom
        died = time.monotonic()
        for t in threads + [collect]:
            t.join(15)
            assert not t.is_alive(), "a request hung after the engine loop died"
        assert time.monotonic() - died < 15
        for o in outs:
            assert o["status"] == 200 and "exception" not in o, o
            assert o["events"][-1] == "[DONE]"
            err = json.loads(o["events"][-2])["error"]
            assert err["code"] == "engine_dead" and "injected engine failure" in err["message"]
            assert all("choices" in json.loads(e) for e in o["events"][:-2])  # tokens before it were intact
        r = collected["r"]
        assert_openai_error(r, 503, None, "engine_dead")
        # later requests fail at once, and the worker reports itself dead
        t0 = time.monotonic()
        assert_openai_error(httpx.post(w.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                       timeout=10), 503, None, "engine_dead")
        assert time.monotonic() - t0 < 5
        h = httpx.get(w.url + "/health", timeout=5)
        assert h.status_code == 503
        client = openai.OpenAI(base_url=w.url + "/v1", api_key="none", max_retries=0, timeout=10)
        with pytest.raises(openai.APIStatusError) as ei:
            client.completions.create(model="stories260K", prompt="Hi", max_tokens=2)
        assert ei.value.status_code == 503


def test_worker_process_exits_non_zero_when_its_engine_dies(tmp_path):
    port = free_port()
    log = open(tmp_path / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, str(HERE / "dying_worker.py"), "20", "--role", "mixed",
                             "--port", str(port), "--kv-cache-memory", "64MiB", "--cpu-threads", "1",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            time.sleep(0.1)
        out: dict = {}
        _stream_events(url, PROMPTS[0], out)
        assert out["status"] == 200
        assert json.loads(out["events"][-2])["error"]["code"] == "engine_dead", out
        assert proc.wait(timeout=20) == ENGINE_DEAD_EXIT_CODE
        text = (tmp_path / "worker.log").read_text()
        assert "injected engine failure" in text and f"exiting with status {ENGINE_DEAD_EXIT_CODE}" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
