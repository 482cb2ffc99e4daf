"""Helpers for tests that run real clusters of OS processes on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and",
    "Lily wanted to bake a cake for her mom, so she",
    "Tom and Sue found a big box in the garden. Inside the box there was",
    "One sunny day, a small bird sat on a branch and sang a happy song. A cat saw the bird and",
    "There was a boy named Ben who loved trucks.",
]

FAST_ENGINE = ["--kv-cache-memory", "64MiB", "--cpu-threads", "1"]


@contextlib.contextmanager
def running_cluster(num_prefill: int = 1, num_decode: int = 1, colocated: bool = False, engine_argv=(),
                    router_argv=(), num_workers: int = 0, echo: bool = False, role_argv=None, **spec_kw):
    """Start a `LocalCluster`, yield it ready, always stop it; `spec_kw`: more `ClusterSpec` fields."""
    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, colocated=colocated, num_workers=num_workers,
                       router_port=free_port(), engine_argv=FAST_ENGINE + list(engine_argv),
                       role_argv=dict(role_argv or {}),
                       router_argv=["--health-check-interval-secs", "0.5", *router_argv], log_level="warning",
                       echo=echo, **spec_kw)
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout=240)
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def running_pd_serve(manifest: Path, argv=(), timeout: float = 240, with_process: bool = False):
    """Run the real `pd-serve` CLI (1P1D by default) with `FAST_ENGINE` + `argv`; yield (router URL, manifest
    dict), plus the `pd-serve` Popen with `with_process`, once ready. On exit, unless the test stopped it: Ctrl-C
    (SIGINT) to the idle cluster, which must end within `IDLE_STOP_BOUND_S`. Then: exit status 0, and every
    worker process gone."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pd_cluster.launch.serve", "--port", str(port), "--manifest",
                             str(manifest), "--log-level", "warning", *FAST_ENGINE, *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    stop_secs = None
    try:
        deadline = time.monotonic() + timeout
        while not manifest.exists():
            assert proc.poll() is None, "pd-serve exited during start-up"
            assert time.monotonic() < deadline, "pd-serve not ready"
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        yield (url, json.loads(manifest.read_text()), proc) if with_process else (url, json.loads(manifest.read_text()))
    finally:
        if proc.poll() is None:
            started = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            proc.wait(60)
            stop_secs = time.monotonic() - started
    assert proc.returncode == 0
    for w in json.loads(manifest.read_text())["workers"]:
        try:
            os.kill(w["pid"], 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {w['pid']} outlived pd-serve")
    # idle, the router exits at once and so do the workers; measured 0.6 s on a 2-core machine, the bound is generous
    assert stop_secs is None or stop_secs < IDLE_STOP_BOUND_S, f"idle Ctrl-C took {stop_secs:.1f} s"


IDLE_STOP_BOUND_S = 10.0


def greedy_token_ids(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy completion through the router at `url`, by the real `openai` client, as token ids
    (``ignore_eos``; one request at a time, no retries)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = []
    for ids in prompts:
        r = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        out.append(r.choices[0].model_dump()["token_ids"])
    return out


def worker_loads(cluster: LocalCluster) -> dict[str, dict]:
    with httpx.Client(timeout=5) as c:
        return {p.name: c.get(p.url + "/get_load").json() for p in cluster.procs if p.alive()}


def wait_all_free(cluster: LocalCluster, timeout: float) -> dict[str, dict]:
    """Poll until every live worker has all pages free and nothing running or queued; return the loads."""
    deadline = time.monotonic() + timeout
    while True:
        loads = worker_loads(cluster)
        if all(_idle(v) for v in loads.values()):
            return loads
        if time.monotonic() > deadline:
            return loads
        time.sleep(0.05)


def _idle(load: dict) -> bool:
    return (load["num_free_pages"] == load["num_total_pages"] and load["num_running_reqs"] == 0
            and load.get("draft_num_free_pages") == load.get("draft_num_total_pages")  # STANDALONE's draft pool
            and load["num_queue_reqs"] == 0 and not load.get("num_prefill_inflight_queue_reqs")
            and not load.get("num_decode_transfer_queue_reqs") and not load.get("num_decode_prealloc_queue_reqs"))


def metric_value(text: str, name: str) -> float:
    """The value of the first sample `name` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):  # the only series, labelled or not
            return float(line.split()[-1])
    raise KeyError(name)


async def stream_pieces(resp, rec: dict):
    """Each completion text piece of a streamed (SSE) response; sets ``rec["done"]`` on ``[DONE]`` and
    ``rec["error"]`` on an error event."""
    async for line in resp.aiter_lines():
        if line == "data: [DONE]":
            rec["done"] = True
        elif line.startswith("data: {"):
            data = json.loads(line[6:])
            if "error" in data:
                rec["error"] = data["error"]
            elif data["choices"] and data["choices"][0]["text"]:
                yield data["choices"][0]["text"]
