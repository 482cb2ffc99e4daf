"""Kubernetes discovery against a loopback API server speaking real pod JSON.

The official client lists and watches; pods turning Ready, NotReady and being
deleted change the registry with the one event that says so; a watch that
expires resumes from its version without a relist; a 410 relists and loses
nothing that changed while events were missed.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_kube_api import FakeKubeApi
from kubernetes import client

from pd_cluster.router.config import CircuitBreakerConfig, KubernetesDiscoveryConfig, Role
from pd_cluster.router.discovery.base import RegistrySink
from pd_cluster.router.discovery.kubernetes import KubernetesDiscovery
from pd_cluster.router.workers import WorkerRegistry

pytestmark = pytest.mark.timeout(60)

PREFILL = {"app": "pd", "component": "prefill"}
DECODE = {"app": "pd", "component": "decode"}


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for: {what}")


def urls(registry: WorkerRegistry, role: Role) -> set[str]:
    return {w.url for w in registry.of_role(role)}


def make_discovery(api: FakeKubeApi, **kw) -> KubernetesDiscovery:
    cfg = KubernetesDiscoveryConfig(
        namespace=api.namespace, prefill_selector="app=pd,component=prefill",
        decode_selector="app=pd,component=decode", port=8000,
        port_annotation="pd-cluster.io/port", **kw)
    return KubernetesDiscovery(cfg, client.ApiClient(client.Configuration(host=api.url)))


@pytest.mark.asyncio
async def test_watch_events_add_and_remove_pods_and_410_resyncs_without_loss():
    with FakeKubeApi() as api:
        api.put_pod("p0", PREFILL, "10.0.0.10", ready=True)
        api.put_pod("p1", PREFILL, "10.0.0.11", ready=False)
        api.put_pod("d0", DECODE, "10.0.1.10", ready=True, annotations={"pd-cluster.io/port": "9100"})
        api.put_pod("other", {"app": "web"}, "10.0.9.9", ready=True)
        registry = WorkerRegistry(CircuitBreakerConfig())
        discovery = make_discovery(api)
        sink = RegistrySink(registry, "kubernetes", asyncio.get_running_loop(), True)
        discovery.start(sink)
        try:
            await until(lambda: urls(registry, Role.PREFILL) == {"http://10.0.0.10:8000"} and
                        urls(registry, Role.DECODE) == {"http://10.0.1.10:9100"}, "initial list")
            assert all(w.healthy and w.source == "kubernetes" for w in registry.all())
            await until(lambda: len(api.watch_requests()) == 2, "both watches open")

            api.put_pod("p1", PREFILL, "10.0.0.11", ready=True)            # NotReady -> Ready
            await until(lambda: "http://10.0.0.11:8000" in urls(registry, Role.PREFILL), "p1 ready")
            api.put_pod("p0", PREFILL, "10.0.0.10", ready=False)           # Ready -> NotReady
            await until(lambda: urls(registry, Role.PREFILL) == {"http://10.0.0.11:8000"},
                        "p0 not ready")
            api.put_pod("p1", PREFILL, "10.0.0.11", ready=True, terminating=True)
            await until(lambda: urls(registry, Role.PREFILL) == set(), "p1 terminating")
            api.put_pod("p2", PREFILL, "10.0.0.12", ready=True)
            api.delete_pod("d0")
            await until(lambda: urls(registry, Role.PREFILL) == {"http://10.0.0.12:8000"} and
                        urls(registry, Role.DECODE) == set(), "p2 added, d0 deleted")
            assert len(api.list_requests()) == 2  # events only, no relist so far

            # Expiry: the watch ends normally and resumes from its version, no relist.
            watches = len(api.watch_requests())
            api.end_watches()
            await until(lambda: len(api.watch_requests()) >= watches + 2, "watches resumed")
            assert len(api.list_requests()) == 2
            resumed = api.watch_requests()[-2:]
            assert all(int(r["resourceVersion"]) > 104 for r in resumed)

            # Changes the watches never see, then compaction: 410 -> relist, nothing lost.
            api.put_pod("p3", PREFILL, "10.0.0.13", ready=True, notify=False)
            api.delete_pod("p2", notify=False)
            api.put_pod("d1", DECODE, "10.0.1.11", ready=True, notify=False)
            api.compact()
            await until(lambda: urls(registry, Role.PREFILL) == {"http://10.0.0.13:8000"} and
                        urls(registry, Role.DECODE) == {"http://10.0.1.11:8000"}, "relist after 410")
            assert len(api.list_requests()) == 4
            await until(lambda: discovery.watch_starts >= 6, "watching again after the relist")
            api.put_pod("d2", DECODE, "10.0.1.12", ready=True)
            await until(lambda: "http://10.0.1.12:8000" in urls(registry, Role.DECODE),
                        "events flow after the resync")
        finally:
            discovery.stop()
            api.end_watches()


@pytest.mark.asyncio
async def test_periodic_resync_repairs_the_registry():
    with FakeKubeApi() as api:
        api.put_pod("p0", PREFILL, "10.0.0.10", ready=True)
        registry = WorkerRegistry(CircuitBreakerConfig())
        discovery = make_discovery(api, resync_secs=1.0)
        discovery.start(RegistrySink(registry, "kubernetes", asyncio.get_running_loop(), True))
        try:
            await until(lambda: urls(registry, Role.PREFILL) == {"http://10.0.0.10:8000"}, "list")
            registry.remove("http://10.0.0.10:8000")   # e.g. removed through the admin API
            registry.add("http://10.9.9.9:8000", Role.PREFILL, "kubernetes", healthy=True)
            await until(lambda: urls(registry, Role.PREFILL) == {"http://10.0.0.10:8000"},
                        "resync", timeout=10)
        finally:
            discovery.stop()
            api.end_watches()


@pytest.mark.slow
def test_router_process_routes_to_pods_found_through_a_kubeconfig(tmp_path):
    """pd-router --service-discovery end to end: pods -> workers -> a routed request."""
    import httpx
    from router_testkit import FakeWorker, RouterProc, wait_http

    with FakeKubeApi() as api, FakeWorker("prefill") as p, \
            FakeWorker("decode", ["--ttft-ms", "5", "--itl-ms", "1"]) as d:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{api.url}'}}}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: fake, namespace: llm}}]\n"
            "users: [{name: fake, user: {token: test-token}}]\n")
        api.put_pod("p0", PREFILL, "127.0.0.1", ready=True,
                    annotations={"pd-cluster.io/port": str(p.port)})
        api.put_pod("d0", DECODE, "127.0.0.1", ready=True,
                    annotations={"pd-cluster.io/port": str(d.port)})
        args = ["--service-discovery", "--kubeconfig", str(kubeconfig),
                "--service-discovery-namespace", "llm",
                "--prefill-selector", "app=pd", "component=prefill",
                "--decode-selector", "app=pd", "component=decode"]
        with RouterProc(args) as router:
            r = httpx.post(router.url + "/v1/completions", timeout=30,
                           headers={"x-request-id": "via-k8s"},
                           json={"model": "stories260K", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Once upon"
            seen = [e for e in d.recent() if e["request_id"] == "via-k8s"]
            assert seen[0]["headers"]["x-pd-prefill-url"] == p.url
            api.put_pod("d0", DECODE, "127.0.0.1", ready=False,
                        annotations={"pd-cluster.io/port": str(d.port)})
            wait_http(router.url + "/readiness", 10, ok=lambda r: r.status_code == 503)
            workers = httpx.get(router.url + "/workers").json()["workers"]
            assert [(w["url"], w["source"]) for w in workers] == [(p.url, "kubernetes")]
