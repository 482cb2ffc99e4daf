"""`pd-serve` on a real 1P1D cluster: ready with keys, workers' /v1 closed to keyless posts, a second `pd-serve` on
its port refused, restarts a killed worker, leaves no orphan when killed.

One `pd-serve` process for the module (real router, real workers, real NIXL between them); the tests run in
file order and the last one kills `pd-serve` itself with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.common.net import free_port

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

FAST_ENGINE = ["--kv-cache-memory", "64MiB", "--cpu-threads", "1"]
API_KEY, ADMIN_KEY = "test-key", "test-admin-key"
PROMPT, MAX_TOKENS = "Once upon a time", 16


@pytest.fixture(scope="module")
def reference() -> str:
    return LLM().generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-serve")
    manifest, log = tmp / "manifest.json", tmp / "pd-serve.log"
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(port), "--manifest",
                                 str(manifest), "--log-level", "warning", "--api-key", API_KEY,
                                 "--admin-api-key", ADMIN_KEY, *FAST_ENGINE],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not manifest.exists():
            assert proc.poll() is None, f"pd-serve exited during start-up:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "pd-serve not ready in 240 s"
            time.sleep(0.2)
        pids |= _pids(manifest)
        yield {"url": f"http://127.0.0.1:{port}", "proc": proc, "manifest": manifest, "log": log, "pids": pids}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        if manifest.exists():
            pids |= _pids(manifest)
        for pid in pids:  # never leave a process of this test behind, whatever failed
            with _gone():
                psutil.Process(pid).kill()


class _gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, psutil.NoSuchProcess)


def _pids(manifest) -> set[int]:
    m = json.loads(manifest.read_text())
    return {m["router"]["pid"], *(w["pid"] for w in m["workers"])}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _complete(url: str, key: str = API_KEY) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    r = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


@pytest.mark.timeout(300)
def test_ready_with_api_and_admin_keys(served, reference):
    url = served["url"]
    assert httpx.get(url + "/readiness", timeout=5).status_code == 200  # ready when the manifest appears
    assert _complete(url) == reference
    with pytest.raises(openai.AuthenticationError):
        _complete(url, key="wrong")
    workers = httpx.get(url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).json()
    assert sorted(w["role"] for w in workers["workers"] if w["healthy"]) == ["decode", "prefill"]
    assert "pd-cluster is ready" in served["log"].read_text()


@pytest.mark.timeout(300)
def test_a_killed_worker_is_restarted_and_serves_again_within_30_s(served, reference):
    url, manifest = served["url"], served["manifest"]
    (decode,) = [w for w in json.loads(manifest.read_text())["workers"] if w["role"] == "decode"]
    os.kill(decode["pid"], signal.SIGKILL)
    killed = time.monotonic()
    text = None
    while time.monotonic() - killed < 30:
        try:
            text = _complete(url)
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.5)
    assert text == reference, f"no answer within 30 s of the kill:\n{served['log'].read_text()[-3000:]}"
    (now,) = [w for w in json.loads(manifest.read_text())["workers"] if w["role"] == "decode"]
    served["pids"].add(now["pid"])
    assert now["pid"] != decode["pid"] and now["restarts"] == 1 and _alive(now["pid"])
    log = served["log"].read_text()
    assert log.count(f"decode-0 (pid {decode['pid']}) exited") == 1  # one true line per event, no repetition
    assert "no decode worker is left" in log and "restarted decode-0" in log
    assert "keeps serving with the rest" not in log


@pytest.mark.timeout(120)
def test_a_worker_v1_refuses_a_post_without_the_internal_key(served, reference):
    """Under ``--api-key`` the workers' /v1 require the cluster's internal key: the router's key cannot be bypassed
    by posting to a worker's port, even naming the real prefill worker."""
    workers = json.loads(served["manifest"].read_text())["workers"]
    (prefill,) = [w for w in workers if w["role"] == "prefill"]
    (decode,) = [w for w in workers if w["role"] == "decode"]
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    for worker in (decode, prefill):
        # no key: 401; the router's key, which is not the internal key: 403
        for headers, status in (({}, 401), ({"Authorization": f"Bearer {API_KEY}"}, 403)):
            r = httpx.post(worker["url"] + "/v1/completions", json=body, timeout=10,
                           headers={"X-PD-Prefill-Url": prefill["url"], **headers})
            assert r.status_code == status, (worker["name"], headers, r.text)
            assert r.json()["error"]["message"]
    assert _complete(served["url"]) == reference  # the router, which sends the internal key, still gets answers


@pytest.mark.timeout(120)
def test_a_second_pd_serve_on_a_taken_port_exits_at_once_naming_it(served, reference, tmp_path):
    port = int(served["url"].rsplit(":", 1)[1])
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(port), "--manifest",
                        str(tmp_path / "m.json"), *FAST_ENGINE], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"port {port}" in r.stderr and "already in use" in r.stderr, r.stderr
    assert not (tmp_path / "m.json").exists()  # never reported ready
    assert time.monotonic() - started < 30  # before any worker started (generous: the import alone takes seconds)
    assert _complete(served["url"]) == reference  # the running cluster is untouched


@pytest.mark.timeout(120)
def test_kill_9_of_pd_serve_leaves_no_router_or_worker_within_5_s(served):
    pids = _pids(served["manifest"])
    assert all(_alive(p) for p in pids)
    os.kill(served["proc"].pid, signal.SIGKILL)
    served["proc"].wait(10)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
