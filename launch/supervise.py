"""Run a started cluster until Ctrl-C or SIGTERM: print where to reach it, report dead members, stop cleanly.

Shared by the process launcher (`launch.cluster.LocalCluster`) and the Ray one (`launch.ray_cluster.RayCluster`);
a cluster offers ``start(timeout)``, ``dead()``, ``stop()``, ``router_url``, ``manifest`` and ``where``.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

import httpx


def serve_until_stopped(cluster, startup_timeout: float, manifest_path: str | None) -> int:
    """0 after a clean stop, 1 when start-up failed."""
    stop = threading.Event()
    try:
        cluster.start(startup_timeout)
        signal.signal(signal.SIGINT, lambda *_: stop.set())  # after start: Ray installs handlers of its own
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if manifest_path:
            with open(manifest_path, "w") as f:
                json.dump(cluster.manifest, f, indent=2)
        print(banner(cluster), flush=True)
        while not stop.wait(0.5):
            dead = cluster.dead()
            if dead:
                print(f"pd-serve: {', '.join(dead)} exited; the cluster keeps serving with the rest "
                      "(the router routes around dead workers)", file=sys.stderr)
                stop.wait(5.0)
    except (RuntimeError, ValueError) as e:
        print(f"pd-serve: {e}", file=sys.stderr)
        return 1
    finally:
        print("pd-serve: stopping", file=sys.stderr)
        cluster.stop()
    return 0


def banner(cluster) -> str:
    m = cluster.manifest
    roles = ", ".join(f"{w['name']} {w['url']}" for w in m["workers"])
    url = cluster.router_url
    model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
    return f"""
pd-cluster is ready {cluster.where} ({roles})
OpenAI endpoint: {url}/v1

  curl {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}}'

  pd-bench --base-url {url} --dataset-name random --random-input-len 200 --random-output-len 100 \\
    --num-prompts 50 --request-rate 5

Ctrl-C stops everything.
"""
