"""``pd-serve --ray-address local``: 1P1D as Ray actors answers what the subprocess launcher answers, then leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest
from cluster_util import FAST_ENGINE, PROMPTS, running_cluster

from pd_cluster.launch.cluster import ClusterSpec, free_port
from pd_cluster.launch.ray_cluster import RayPlacement, plan_placement, router_argv, worker_argv

pytest.importorskip("ray")
MAX_TOKENS = 32


def completions(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    return [client.completions.create(model="stories260K", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0].text for p in PROMPTS]


def live(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            pass
    return out


def session_processes(session_dir: str) -> list[str]:
    """Processes whose command line names this Ray session (raylet, gcs_server, agents, workers)."""
    name = os.path.basename(session_dir)
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(name in part for part in p.info["cmdline"] or []):
            out.append(f"{p.info['pid']} {' '.join(p.info['cmdline'])[:100]}")
    return out


def stop_and_wait_for_no_ray_process(cluster) -> None:
    """Stop a `RayCluster` and assert, within 30 s, that no process of its Ray session is left."""
    session = cluster.manifest.get("ray", {}).get("session_dir")
    cluster.stop()
    deadline = time.monotonic() + 30
    while session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_processes(session) == []


@pytest.fixture(scope="module")
def ray_serve(tmp_path_factory):
    """Start ``pd-serve --ray-address local``; yield its URL, manifest and process tree; Ctrl-C it at the end."""
    manifest = tmp_path_factory.mktemp("ray") / "manifest.json"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.launch.serve", "--ray-address", "local", "--port", str(port),
                             "--manifest", str(manifest), "--log-level", "warning", *FAST_ENGINE],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = {"proc": proc, "tree": set()}
    try:
        deadline = time.monotonic() + 300
        while not manifest.exists():
            assert proc.poll() is None, "pd-serve --ray-address local exited during start-up"
            assert time.monotonic() < deadline, "pd-serve --ray-address local not ready"
            time.sleep(0.5)
        time.sleep(0.5)  # the manifest is written in one call; let it land
        state["manifest"] = json.loads(manifest.read_text())
        state["tree"] = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        yield f"http://127.0.0.1:{port}", state
    finally:
        if proc.poll() is None:
            state["tree"] |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            state["returncode"] = proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_local_1p1d_answers_like_the_subprocess_launcher_and_leaves_no_process(ray_serve):
    url, state = ray_serve
    m = state["manifest"]
    assert sorted(w["role"] for w in m["workers"]) == ["decode", "prefill"]
    assert {w["name"] for w in m["workers"]} == {"pd-worker-prefill-0", "pd-worker-decode-0"}
    assert m["ray"]["local"] is True and m["ray"]["gpus_per_worker"] == 0
    children = {w["pid"] for w in m["workers"]} | {m["router"]["pid"]}
    assert children <= state["tree"], "the worker and router processes run under the local Ray instance"
    assert any("raylet" in line for line in live(state["tree"]))
    ray_texts = completions(url)

    # Ctrl-C, then nothing of this run may remain: not the workers, the router, nor any Ray process.
    proc = state["proc"]
    state["tree"] |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(120) == 0
    deadline = time.monotonic() + 30
    while (live(state["tree"]) or session_processes(m["ray"]["session_dir"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert live(state["tree"]) == []
    assert session_processes(m["ray"]["session_dir"]) == []

    with running_cluster(1, 1) as cluster:  # the subprocess launcher, same engine flags
        local_texts = completions(cluster.router_url)
    assert ray_texts == local_texts
    assert all(len(t) > 20 for t in ray_texts)


def test_placement_reserves_a_whole_8_gpu_node_by_default():
    assert plan_placement(None, [8.0, 8.0]).bundle() == {"CPU": 1.0, "GPU": 8.0}
    assert plan_placement(None, [4.0]).gpus_per_worker == 4
    assert plan_placement(2, [8.0]).bundle() == {"CPU": 1.0, "GPU": 2.0}
    assert plan_placement(None, []).bundle() == {"CPU": 1.0}
    assert plan_placement(8, [0.0]) == RayPlacement(0)
    with pytest.raises(ValueError, match="largest node has 8"):
        plan_placement(16, [8.0, 8.0])


def test_argv_matches_the_worker_and_router_parsers():
    from pd_cluster.launch import worker as launch_worker
    from pd_cluster.router import args as router_args

    spec = ClusterSpec(engine_argv=["--page-size", "16"], router_argv=["--prefill-policy", "round_robin"])
    w = launch_worker.build_parser().parse_args(worker_argv("decode", "10.0.0.5", 31000, spec))
    assert (w.role, w.host, w.port, w.advertise_url, w.page_size) == (
        "decode", "10.0.0.5", 31000, "http://10.0.0.5:31000", 16)
    cfg = router_args.config_from_args(router_args.build_parser().parse_args(
        router_argv(spec, "10.0.0.1:6379", "pd-cluster-x")))
    assert (cfg.ray.address, cfg.ray.namespace, cfg.ray.actor_prefix) == ("10.0.0.1:6379", "pd-cluster-x", "pd-worker")
    assert cfg.policy.prefill == "round_robin" and cfg.port == spec.router_port
    # no tokenizer, as LocalCluster: cache_aware routes on KV events through the workers' text-to-page maps
    assert cfg.policy.kv.tokenizer_path is None and cfg.policy.kv.enabled
    named = ClusterSpec(engine_argv=["--model", "/models/m"], router_argv=["--tokenizer=/mine"])
    argv = router_argv(named, "a:1", "n")
    assert "--tokenizer-path" not in argv and router_args.build_parser().parse_args(argv).tokenizer_path == "/mine"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_actor_takes_its_process_with_it():
    """Ray killing an actor (node loss, OOM, ray.kill) must not leave its worker process serving as an orphan."""
    import ray

    from pd_cluster.launch.ray_cluster import RayCluster

    spec = ClusterSpec(router_port=free_port(), engine_argv=list(FAST_ENGINE), log_level="warning", echo=False)
    cluster = RayCluster("local", spec, None)
    try:
        cluster.start(300)
        decode = next(w for w in cluster.manifest["workers"] if w["role"] == "decode")
        ray.kill(ray.get_actor(decode["name"]))
        deadline = time.monotonic() + 30
        while live({decode["pid"]}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert live({decode["pid"]}) == []
        assert cluster.dead() == [decode["name"]]
    finally:
        stop_and_wait_for_no_ray_process(cluster)
    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_worker_process_is_restarted_by_ray_and_rejoins_the_router():
    """SIGKILL a worker's process: its actor ends, Ray restarts it (``max_restarts``), the new process serves on a
    new URL under the same actor name, the router's discovery moves there, and answers are the same as before."""
    import httpx

    from pd_cluster.launch.ray_cluster import RayCluster

    spec = ClusterSpec(router_port=free_port(), engine_argv=list(FAST_ENGINE), log_level="warning", echo=False,
                       router_argv=["--health-check-interval-secs", "0.5"])
    cluster = RayCluster("local", spec, None)
    try:
        cluster.start(300)
        url = cluster.router_url
        before = completions(url)
        decode = dict(next(w for w in cluster.manifest["workers"] if w["role"] == "decode"))
        os.kill(decode["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not cluster.tend():
            time.sleep(0.5)
        now = next(w for w in cluster.manifest["workers"] if w["name"] == decode["name"])
        assert now["restarts"] == 1 and now["pid"] != decode["pid"] and now["url"] != decode["url"], now
        with httpx.Client(timeout=10) as c:
            while time.monotonic() < deadline:
                workers = {w["url"]: w for w in c.get(url + "/workers").json()["workers"]}
                if now["url"] in workers and workers[now["url"]]["healthy"] and decode["url"] not in workers:
                    break
                time.sleep(0.5)
        assert now["url"] in workers and decode["url"] not in workers, workers
        assert completions(url) == before
        assert live({decode["pid"]}) == []
    finally:
        stop_and_wait_for_no_ray_process(cluster)
