"""A stand-in for the router's admin API and the workers' ``/get_load`` (`httpx.MockTransport`), for the connectors'
action sequences; the real router's side of these calls is tested in tests/router/test_drain_units.py and
tests/router/test_role_switch_units.py, and the whole path on real processes in tests/cluster/test_autoscale.py."""

from __future__ import annotations

import json

import httpx


class FakeRouter:
    """The router's admin API and the workers' ``/get_load``, over `httpx.MockTransport`, logging into `log`."""

    def __init__(self, log: list, workers: list[dict], busy_polls: int = 3) -> None:
        self.log, self.workers, self.busy_polls = log, workers, busy_polls

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.log.append(("router", request.method, f"{request.url.host}{path}"))
        if path == "/workers":
            for w in self.workers:  # a pod the StatefulSet added turns healthy at the router's next look
                w["healthy"] = True
            return httpx.Response(200, json={"workers": self.workers})
        if path.endswith("/drain"):
            w = next(w for w in self.workers if w["id"] == path.split("/")[2])
            w["draining"] = request.method == "POST"
            return httpx.Response(200, json=dict(w, drain_secs=0.0))
        if path.endswith("/role"):
            w = next(w for w in self.workers if w["id"] == path.split("/")[2])
            w["role"] = json.loads(request.content)["role"]
            return httpx.Response(200, json=dict(w, switched=True, switch_secs=0.1))
        if path == "/get_load":
            self.busy_polls -= 1
            running = 1 if self.busy_polls >= 0 else 0
            return httpx.Response(200, json={"num_running_reqs": running, "num_queue_reqs": 0,
                                             "num_free_pages": 100 - 4 * running, "num_total_pages": 100})
        return httpx.Response(404)


def worker_entry(ip: str, role: str, healthy: bool = True) -> dict:
    """A ``GET /workers`` entry of the worker at `ip`."""
    return {"id": f"w-{ip}", "url": f"http://{ip}:8000", "role": role, "healthy": healthy, "draining": False,
            "switching_to": None, "inflight": 0}
