"""Internal security on a real 1P1D `pd-serve` with client and admin keys.

One `pd-serve` process for the module (real router, real workers, real NIXL between them). pd-serve
generates the cluster's internal key and gives it to every child through its environment; the tests read
it there (as an operator's tooling could) and check that worker-internal endpoints refuse calls without
it, that decode contacts only the cluster's prefill workers, that the cluster still serves the exact
greedy text, and that every listening socket of the workers (HTTP and the NIXL/UCX transfer listeners)
is bound to the configured host.
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
HOST = "127.0.0.1"
KEY_ENV = "PD_INTERNAL_API_KEY"


@pytest.fixture(scope="module")
def reference() -> str:
    return LLM().generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-serve-security")
    manifest, log = tmp / "manifest.json", tmp / "pd-serve.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, "UCX_NET_DEVICES")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.launch.serve", "--host", HOST, "--port", str(port),
                                 "--manifest", str(manifest), "--log-level", "warning", "--api-key", API_KEY,
                                 "--admin-api-key", ADMIN_KEY, *FAST_ENGINE],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not manifest.exists():
            assert proc.poll() is None, f"pd-serve exited during start-up:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "pd-serve not ready in 240 s"
            time.sleep(0.2)
        m = json.loads(manifest.read_text())
        pids |= {m["router"]["pid"], *(w["pid"] for w in m["workers"])}
        workers = {w["role"]: w for w in m["workers"]}
        yield {"url": f"http://{HOST}:{port}", "router": m["router"], "prefill": workers["prefill"],
               "decode": workers["decode"], "log": log}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        for pid in pids:  # never leave a process of this test behind, whatever failed
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture(scope="module")
def internal_key(served) -> str:
    """The key pd-serve generated, read from the workers' environment (the same in every process)."""
    keys = {psutil.Process(served[r]["pid"]).environ().get(KEY_ENV) for r in ("router", "prefill", "decode")}
    assert len(keys) == 1 and None not in keys, "every process of the cluster holds the same internal key"
    key = keys.pop()
    assert len(key) >= 32
    for r in ("router", "prefill", "decode"):  # never on a command line (ps shows those to every user)
        assert not any(key in a for a in psutil.Process(served[r]["pid"]).cmdline())
    return key


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.timeout(300)
def test_serves_the_exact_greedy_text_with_every_key_on(served, internal_key, reference):
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    r = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference
    workers = httpx.get(served["url"] + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
    assert sorted(w["role"] for w in workers.json()["workers"] if w["healthy"]) == ["decode", "prefill"]


@pytest.mark.timeout(120)
def test_worker_internal_endpoints_need_the_internal_key(served, internal_key):
    prefill, decode = served["prefill"]["url"], served["decode"]["url"]
    good = {"X-PD-Internal-Key": internal_key}
    with httpx.Client(timeout=10) as c:
        calls = [("POST", prefill + "/prefill", {"request_id": "x"}), ("POST", prefill + "/abort", {"request_id": "x"}),
                 ("GET", prefill + "/kv_transfer/info", None), ("GET", decode + "/kv_transfer/info", None)]
        for method, url, body in calls:
            err = _openai_error(c.request(method, url, json=body), 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_internal_key"
            _openai_error(c.request(method, url, json=body, headers={"X-PD-Internal-Key": "wrong"}), 403)
            _openai_error(c.request(method, url, json=body, headers={"Authorization": "Bearer wrong"}), 403)
        # with the key, the calls reach their handlers
        assert c.post(prefill + "/abort", json={"request_id": "x"}, headers=good).json() == {
            "request_id": "x", "aborted": True}
        assert c.get(decode + "/kv_transfer/info", headers=good).json()["role"] == "decode"
        assert c.get(prefill + "/kv_transfer/info", headers={"Authorization": f"Bearer {internal_key}"}
                     ).json()["role"] == "prefill"
        _openai_error(c.post(prefill + "/prefill", content=b"{}", headers=good), 400)  # the handler's own check
        # probes stay open
        assert c.get(prefill + "/health").status_code == 200 and c.get(decode + "/health").status_code == 200
    assert "refused POST /prefill" in _wait_for_log(served["log"], "refused POST /prefill")


def _wait_for_log(log, text: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        content = log.read_text()
        if text in content or time.monotonic() > deadline:
            return content
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_under_an_api_key_the_workers_v1_needs_the_internal_key(served, internal_key, reference):
    """pd-serve --api-key turns on the workers' --internal-api-key-protects-v1: the router's key cannot be bypassed
    through a worker's port, whatever prefill URL is named (the allow-list of prefill URLs, which applies without
    --api-key, is tested in tests/cluster/test_pd_serve.py)."""
    decode, prefill = served["decode"]["url"], served["prefill"]["url"]
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(timeout=30) as c:
        for url in (f"http://{HOST}:1", "http://169.254.169.254/latest", prefill):
            err = _openai_error(c.post(decode + "/v1/completions", json=body, headers={"X-PD-Prefill-Url": url}),
                                401)
            assert err["code"] == "invalid_internal_key"
        # the internal key (what the router sends) is accepted
        r = c.post(decode + "/v1/completions", json=body, headers={"X-PD-Prefill-Url": prefill,
                                                                    "X-PD-Internal-Key": internal_key})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
        load = c.get(decode + "/get_load").json()
    assert load["num_decode_prealloc_queue_reqs"] == 0 and load["num_decode_transfer_queue_reqs"] == 0


@pytest.mark.timeout(60)
def test_every_listener_of_the_workers_binds_only_the_configured_host(served, reference):
    for role in ("prefill", "decode", "router"):
        proc = psutil.Process(served[role]["pid"])
        listening = [c.laddr for p in [proc, *proc.children(recursive=True)]
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert listening, f"{role} listens nowhere?"
        assert {a.ip for a in listening} == {HOST}, f"{role} listens on {listening}"
        if role != "router":  # the HTTP server plus the UCX listeners of the data and control agents
            assert len(listening) >= 3, f"{role}: {listening}"
