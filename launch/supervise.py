"""Run a started cluster until Ctrl-C or SIGTERM: print where to reach it, restart what dies, stop cleanly.

Shared by the process launcher (`launch.cluster.LocalCluster`) and the Ray one (`launch.ray_cluster.RayCluster`);
a cluster offers ``start(timeout)``, ``tend()``, ``stop()``, ``router_url``, ``manifest`` and ``where``;
``tend()`` is one supervision step and returns True when the manifest changed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from pd_cluster.launch.cluster import LocalCluster


def serve_until_stopped(cluster, startup_timeout: float, manifest_path: str | None,
                        api_key: str | None = None) -> int:
    """0 after a clean stop, 1 when start-up failed.

    The first Ctrl-C or SIGTERM stops the cluster as `cluster.stop` does (`LocalCluster.stop`: the router drains,
    then the workers stop); a second one during that drain kills what is left at once.
    """
    stop, force = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():
            print("pd-serve: second stop signal: killing what is left", file=sys.stderr, flush=True)
            force.set()
        stop.set()

    try:
        cluster.start(startup_timeout)
        signal.signal(signal.SIGINT, on_signal)  # after start: Ray installs handlers of its own
        signal.signal(signal.SIGTERM, on_signal)
        _write_manifest(cluster, manifest_path)
        print(banner(cluster, api_key), flush=True)
        while not stop.wait(0.5):
            if cluster.tend():
                _write_manifest(cluster, manifest_path)
    except (RuntimeError, ValueError) as e:
        print(f"pd-serve: {e}", file=sys.stderr)
        return 1
    finally:
        print("pd-serve: stopping" + (" (the router drains first; Ctrl-C again to kill at once)" if stop.is_set()
                                      else ""), file=sys.stderr, flush=True)
        if isinstance(cluster, LocalCluster):
            cluster.stop(force=force)
        else:
            cluster.stop()
    return 0


def _write_manifest(cluster, path: str | None) -> None:
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(cluster.manifest, f, indent=2)
    os.replace(path + ".tmp", path)  # readers never see half a file


def served_model_name(worker_urls: list[str]) -> str:
    """The served model name, from the first worker that answers ``/server_info`` (workers need no key)."""
    import httpx

    for url in worker_urls:
        try:
            info = httpx.get(url + "/server_info", timeout=5).json()
            return info.get("served_model_name") or info["model"]
        except (httpx.HTTPError, ValueError, KeyError):
            continue
    return "MODEL"


def banner(cluster, api_key: str | None = None) -> str:
    """What ``pd-serve`` prints once the router's ``/readiness`` is 200."""
    m = cluster.manifest
    roles = ", ".join(f"{w['name']} {w['url']}" for w in m["workers"])
    url = cluster.router_url
    model = served_model_name([w["url"] for w in m["workers"]])
    auth = " -H 'Authorization: Bearer YOUR_API_KEY'" if api_key else ""
    bench_key = " --api-key YOUR_API_KEY" if api_key else ""
    return f"""
pd-cluster is ready {cluster.where} ({roles})
OpenAI endpoint: {url}/v1

  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}}'

  pd-bench --base-url {url}{bench_key} --dataset-name random --random-input-len 200 --random-output-len 100 \\
    --num-prompts 50 --request-rate 5

Ctrl-C stops everything.
"""
