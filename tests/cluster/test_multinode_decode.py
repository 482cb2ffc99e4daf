"""A decode instance over two "nodes": its two TP ranks are two `pd-worker` processes on loopback, started with the
same arguments and the environment a LeaderWorkerSet gives its pods (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``,
``LWS_WORKER_INDEX``; no node flag), behind a prefill instance that spans two nodes too (explicit ``--nnodes``,
``--node-rank``, ``--dist-init-addr``) and the router. The real `openai` client gets transformers' greedy tokens of a
tiny random Llama (fp32 KV), each decode rank receiving its own KV heads over its own NIXL agent from the prefill rank
of its node; a node 1 serves only ``/health``. Then kill -9 of the decode's node 1 while a stream is decoding: the
stream ends with an error within a bound, node 0 exits, and the prefill holds no page; kill -9 of the prefill's node
0: its node 1 exits with the reason. Node 0 alone, with no node 1, fails start-up naming the flags and address."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from cluster_util import FAST_ENGINE, greedy_token_ids
from reuse_util import counters

from pd_cluster.common.net import free_port
from pd_cluster.engine.parallel.nodes import DEFAULT_DIST_INIT_PORT
from pd_cluster.launch.cluster import router_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE = [*FAST_ENGINE, "--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "8",
          "--log-level", "warning"]
MAX_TOKENS = 12
END_BOUND_S = 30.0  # a stream whose decode lost a rank ends within this (measured: about 1 s on 2 cores)


def _start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start `argv` in its own session; its stderr goes to a file (`_stderr` reads it), never a pipe it could fill."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *argv], env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                            stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True)
    proc.log = log
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()


def _worker(role: str, port: int, model, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return _start(["-m", "pd_cluster.launch.worker", "--role", role, "--host", "127.0.0.1", "--port", str(port),
                   "--model", str(model), *ENGINE, *extra], env)


def _lws(index: int) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index)}


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # our own session: the worker and its rank processes
            p.wait(30)


def _wait(url: str, path: str, procs, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            assert p.poll() is None, f"exited during start-up: {_stderr(p)[-3000:]}"
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url}{path} not ready"
        time.sleep(0.3)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the TCP store binds: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from random_models import build, hf_greedy_batch, long_prompt_ids

    model = tmp_path_factory.mktemp("llama3") / "llama3-tiny"
    hf = build("llama3-rope-scaling", model, num_key_value_heads=4)  # two KV heads on each decode rank
    prompts = long_prompt_ids(2, (40, 53))
    return model, hf, prompts, hf_greedy_batch(hf, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(llama):
    model = llama[0]
    assert _port_is_free(DEFAULT_DIST_INIT_PORT), f"port {DEFAULT_DIST_INIT_PORT} (LWS rendezvous) is taken"
    pp, pp1, dp, dp1, rp = free_port(), free_port(), free_port(), free_port(), free_port()
    prefill, decode = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    # the prefill also spans two nodes, by explicit flags: its ranks' heartbeats learn each ticket through the store
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    procs = {"prefill": _worker("prefill", pp, model, *nodes, "--node-rank", "0"),
             "prefill1": _worker("prefill", pp1, model, *nodes, "--node-rank", "1")}
    same = ["--tp-size", "2", "--prefill-urls", prefill]  # every pod of the group gets these
    procs["node0"] = _worker("decode", dp, model, *same, env=_lws(0))
    procs["node1"] = _worker("decode", dp1, model, *same, env=_lws(1))  # its own port: both "pods" share a host
    try:
        _wait(prefill, "/health", procs.values())
        _wait(decode, "/health", procs.values())
        procs["router"] = _start(["-m", "pd_cluster.router.main", "--host", "127.0.0.1", "--port", str(rp),
                                  "--prefill", prefill, "--decode", decode, "--health-check-interval-secs", "0.5",
                                  "--log-level", "warning"])
        router = f"http://127.0.0.1:{rp}"
        deadline = time.monotonic() + 60
        with httpx.Client() as c:
            while not router_ready(c, router):
                assert time.monotonic() < deadline, "router not ready"
                time.sleep(0.2)
        yield {"router": router, "prefill": prefill, "decode": decode, "node1": f"http://127.0.0.1:{dp1}",
               "procs": procs}
    finally:
        _stop(procs.values())


def _free(url: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        load = httpx.get(url + "/get_load", timeout=5).json()
        if load["num_free_pages"] == load["num_total_pages"] or time.monotonic() > deadline:
            return load


def test_two_node_decode_gives_transformers_greedy_tokens(llama, cluster):
    model, hf, prompts, expected = llama
    assert greedy_token_ids(cluster["router"], model.name, prompts, MAX_TOKENS) == expected
    for role in ("prefill", "decode"):
        load = _free(cluster[role])
        assert load["num_free_pages"] == load["num_total_pages"], (role, load)
    # each decode rank received its own two KV heads from the prefill rank of its node: the served counters add
    # node 1's ranks' bytes
    c = hf.config
    page_bytes = c.num_hidden_layers * 2 * c.num_key_value_heads * 16 * (c.hidden_size // c.num_attention_heads) * 4
    pages = sum(-(-len(ids) // 16) for ids in prompts)
    assert counters(cluster["decode"])["pd:kv_transfer_received_bytes_total"] == pages * page_bytes
    assert counters(cluster["prefill"])["pd:kv_transfer_bytes_total"] == pages * page_bytes
    info = httpx.get(cluster["decode"] + "/kv_transfer/info", timeout=10).json()
    assert len(info["tp_peers"]) == 1  # node 1's rank has its own agent, announced by rank 0
    # node 1 answers its pod's probes and nothing else
    assert httpx.get(cluster["node1"] + "/health", timeout=5).json() == {"status": "ok", "node_rank": 1}
    assert httpx.get(cluster["node1"] + "/v1/models", timeout=5).status_code == 404


def test_kill_9_of_node_1_ends_the_stream_with_an_error_and_leaks_no_prefill_page(llama, cluster):
    model, _, prompts, _ = llama
    procs = cluster["procs"]
    body = {"model": model.name, "prompt": prompts[0], "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    pieces, error, done = 0, None, False
    with httpx.stream("POST", cluster["router"] + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]
                elif data["choices"] and data["choices"][0]["text"]:
                    pieces += 1
                    if pieces == 5:
                        os.kill(procs["node1"].pid, signal.SIGKILL)
                        killed = time.monotonic()
    ended = time.monotonic() - killed
    assert 5 <= pieces < body["max_tokens"] and error is not None, (pieces, done, error)  # cut short, with an error
    assert ended < END_BOUND_S, ended
    assert "the tensor-parallel group broke" in error["message"], error
    assert procs["node0"].wait(END_BOUND_S) != 0  # the instance goes down as a unit (its supervisor restarts it)
    load = _free(cluster["prefill"])
    assert load["num_free_pages"] == load["num_total_pages"] and load["num_running_reqs"] == 0, load


def test_kill_9_of_node_0_ends_node_1_with_an_error_naming_the_address(cluster):
    """The prefill instance: its node 1 exits, non-zero, with the reason, once rank 0 is gone."""
    procs = cluster["procs"]
    os.kill(procs["prefill"].pid, signal.SIGKILL)
    started = time.monotonic()
    assert procs["prefill1"].wait(END_BOUND_S) == 1
    assert time.monotonic() - started < END_BOUND_S
    err = _stderr(procs["prefill1"])
    assert "pd-worker: error: node 1: rank 0 at --dist-init-addr 127.0.0.1:" in err and "is gone or failed" in err, err


def test_node_0_without_node_1_fails_start_up_naming_the_flags(tmp_path):
    port = free_port()
    node0 = _start(["-m", "pd_cluster.launch.worker", "--role", "decode", "--port", str(free_port()), *ENGINE,
                    "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "2"])
    try:
        assert node0.wait(60) == 2
        err = _stderr(node0)
    finally:
        _stop([node0])
    assert (f"pd-worker: error: node(s) 1 of --nnodes 2 did not join at --dist-init-addr 127.0.0.1:{port} within 2 s "
            "(--dist-timeout)") in err, err[-2000:]
