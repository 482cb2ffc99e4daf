"""``pd-serve --ray-address local --autoscale``: the planner's Ray connector, for real (a local Ray instance, worker
actors, real NIXL and HTTP).

With ``--ttft-slo-ms 1`` any load is prefill pressure: under a steady stream of requests the planner starts a second
prefill worker as a new Ray actor (its own placement group, found by the router's Ray discovery); once the load
stops it drains one prefill worker and stops its actor. Every request of both phases gets the offline greedy text,
the stopped worker's server is gone, no worker holds a page, and Ctrl-C leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from cluster_util import FAST_ENGINE

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.launch.cluster import free_port

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Once upon a time", "The little dog ran", "Lily and Tom went to the park", "One day a bird"]
MAX_TOKENS = 8
FLAGS = ["--autoscale", "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "1",
         "--ttft-slo-ms", "1", "--itl-slo-ms", "100000", "--planner-interval-secs", "0.5",
         "--planner-stable-intervals", "2", "--planner-cooldown-secs", "2", "--planner-scale-down-window-secs", "0"]


def _manifest(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # being rewritten
        return {}


def _prefills(path) -> list[dict]:
    return [w for w in _manifest(path).get("workers", []) if w["role"] == "prefill"]


def _load(url: str, stop: threading.Event, out: list, limit: int, seconds: float = 300.0) -> None:
    """Requests one after another until `stop`, `limit` requests or `seconds`: (prompt, status, text)."""
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120) as client:
        for i in range(limit):
            if stop.is_set() or time.monotonic() > deadline:
                return
            prompt = PROMPTS[i % len(PROMPTS)]
            r = client.post(url + "/v1/completions", json={"model": "stories260K", "prompt": prompt,
                                                           "max_tokens": MAX_TOKENS, "temperature": 0,
                                                           "ignore_eos": True})
            out.append((prompt, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))


def _free(url: str) -> bool:
    """Nothing running or queued on the worker at `url`, and every page free."""
    load = httpx.get(url + "/get_load", timeout=5).json()
    return (load["num_free_pages"] == load["num_total_pages"] and load["num_running_reqs"] == 0
            and load["num_queue_reqs"] == 0)


def _wait(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def _why(manifest, log) -> str:
    """What a failed wait saw: the manifest's workers, the planner's actions and the tail of pd-serve's log."""
    m = _manifest(manifest)
    try:
        actions = [ln for ln in httpx.get(m["planner"]["metrics_url"], timeout=5).text.splitlines()
                   if ln.startswith(("pd:planner_actions_total", "pd:planner_target_workers"))]
    except (KeyError, httpx.HTTPError) as e:
        actions = [repr(e)]
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    return f"workers: {m.get('workers')}\nplanner: {actions}\npd-serve log tail:\n{tail}"


def test_the_planner_starts_and_drains_prefill_actors_on_ray(tmp_path):
    llm = LLM(page_size=16)
    refs = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)))}
    llm.engine.close()
    manifest, port, log = tmp_path / "manifest.json", free_port(), tmp_path / "pd-serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.launch.serve", "--ray-address", "local", "--port",
                                 str(port), "--manifest", str(manifest), "--log-level", "info", *FAST_ENGINE,
                                 *FLAGS], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    tree: set[int] = set()
    try:
        assert _wait(lambda: proc.poll() is not None or bool(_manifest(manifest).get("planner")), 300), \
            "pd-serve --ray-address local --autoscale not ready"
        assert proc.poll() is None
        first = _prefills(manifest)
        assert [w["name"] for w in first] == ["pd-worker-prefill-0"]
        # steady load until the second prefill serves (a request loop bounded at 4,000 requests and 300 s): TTFT
        # over 1 ms is prefill pressure, the planner starts a second prefill actor. A load that ended before the
        # new actor served would leave the planner calm, and it would drain that actor again.
        stop, records = threading.Event(), []
        t = threading.Thread(target=_load, args=(url, stop, records, 4000), daemon=True)
        t.start()
        def second_serves() -> bool:
            prefills = _prefills(manifest)  # read once: a drain may rewrite it between two reads
            return len(prefills) == 2 and any(w["url"] == prefills[1]["url"] and w["healthy"]
                                              for w in httpx.get(url + "/workers", timeout=10).json()["workers"])

        grew = _wait(second_serves, 240)
        time.sleep(2)  # a few requests at 2P1D
        stop.set()
        t.join(180)
        assert grew, _why(manifest, log)
        new = _prefills(manifest)[1]
        assert new["name"] == "pd-worker-prefill-1"
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert new["pid"] in tree  # a process of this Ray instance
        # no load: every signal calm, the planner drains one prefill worker and stops its actor
        assert _wait(lambda: len(_prefills(manifest)) == 1, 120), _why(manifest, log)
        gone = next(w for w in (first + [new]) if w["url"] not in {p["url"] for p in _prefills(manifest)})
        assert _wait(lambda: not psutil.pid_exists(gone["pid"]) or
                     psutil.Process(gone["pid"]).status() == psutil.STATUS_ZOMBIE, 60)
        with pytest.raises(httpx.HTTPError):
            httpx.get(gone["url"] + "/health", timeout=2)
        assert _wait(lambda: sorted(w["role"] for w in httpx.get(url + "/workers", timeout=10).json()["workers"])
                     == ["decode", "prefill"], 30)
        after: list = []
        _load(url, threading.Event(), after, 4)
        wrong = [r for r in records + after if r[1] != 200 or r[2] != refs[r[0]]]
        assert not wrong and len(records) >= 3, (wrong[:3], len(records))
        metrics = httpx.get(_manifest(manifest)["planner"]["metrics_url"], timeout=10).text
        assert 'pd:planner_actions_total{action="start",outcome="ok",role="prefill"} 1.0' in metrics
        assert 'pd:planner_actions_total{action="drain",outcome="ok",role="prefill"} 1.0' in metrics
        workers = _manifest(manifest)["workers"]
        assert _wait(lambda: all(_free(w["url"]) for w in workers), 30), [
            httpx.get(w["url"] + "/get_load", timeout=5).json() for w in workers]
    finally:
        if proc.poll() is None:
            tree |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0
    assert _wait(lambda: not [p for p in tree if psutil.pid_exists(p) and
                              psutil.Process(p).status() != psutil.STATUS_ZOMBIE], 30)
