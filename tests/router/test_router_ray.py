"""Ray discovery against a real local Ray: workers as named actors exposing endpoint()."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_cluster.router.config import CircuitBreakerConfig, RayDiscoveryConfig, Role
from pd_cluster.router.discovery.base import RegistrySink
from pd_cluster.router.discovery.ray import RayDiscovery, parse_endpoint
from pd_cluster.router.workers import WorkerRegistry

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

NAMESPACE = "pd-router-test"


@ray.remote(num_cpus=0)
class FakeWorkerActor:
    """Stands in for a pd-worker actor: it only reports where it listens."""

    def __init__(self, url: str, role: str) -> None:
        self._info = {"url": url, "role": role}

    def endpoint(self) -> dict:
        return self._info


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


async def until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {what}")


def test_parse_endpoint_checks_the_contract():
    assert parse_endpoint({"url": "http://h:1", "role": "decode"}) == ("http://h:1", Role.DECODE)
    for bad in (None, {"url": 3, "role": "decode"}, {"url": "http://h:1", "role": "teacher"}):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


@pytest.mark.asyncio
async def test_named_actors_join_and_leave_the_registry(local_ray):
    p = FakeWorkerActor.options(name="pd-worker-prefill-0", lifetime="detached").remote(
        "http://10.1.0.1:8000", "prefill")
    d = FakeWorkerActor.options(name="pd-worker-decode-0", lifetime="detached").remote(
        "http://10.1.0.2:8000", "decode")
    stranger = FakeWorkerActor.options(name="metrics-exporter").remote("http://10.1.0.3:1", "mixed")
    ray.get([a.endpoint.remote() for a in (p, d, stranger)])
    registry = WorkerRegistry(CircuitBreakerConfig())
    source = RayDiscovery(RayDiscoveryConfig(namespace=NAMESPACE, poll_secs=0.2))
    source.start(RegistrySink(registry, "ray", asyncio.get_running_loop(), False))
    try:
        await until(lambda: {(w.url, w.role) for w in registry.all()} == {
            ("http://10.1.0.1:8000", Role.PREFILL), ("http://10.1.0.2:8000", Role.DECODE)},
            "both worker actors found")
        assert not any(w.healthy for w in registry.all())  # they still need a health check
        ray.kill(d)
        await until(lambda: {w.url for w in registry.all()} == {"http://10.1.0.1:8000"},
                    "killed actor removed")
    finally:
        source.stop()
        for actor in (p, stranger):
            ray.kill(actor)


@ray.remote(num_cpus=0, max_restarts=1)
class RestartingWorkerActor:
    """A worker actor whose URL changes with its process, like `ProcessActor` (a new free port per start)."""

    def __init__(self, role: str) -> None:
        import os

        self._info = {"url": f"http://10.1.1.1:{20000 + os.getpid() % 40000}", "role": role}

    def endpoint(self) -> dict:
        return self._info

    def pid(self) -> int:
        import os

        return os.getpid()


@pytest.mark.asyncio
async def test_an_actor_restarted_by_ray_moves_to_its_new_url(local_ray):
    a = RestartingWorkerActor.options(name="pd-worker-decode-7").remote("decode")
    first = ray.get(a.endpoint.remote())["url"]
    registry = WorkerRegistry(CircuitBreakerConfig())
    source = RayDiscovery(RayDiscoveryConfig(namespace=NAMESPACE, poll_secs=0.2))
    source.start(RegistrySink(registry, "ray", asyncio.get_running_loop(), False))
    try:
        await until(lambda: {w.url for w in registry.all()} == {first}, "the actor found")
        old_pid = ray.get(a.pid.remote())
        ray.kill(a, no_restart=False)  # its process dies; Ray restarts it under the same name
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ray.get(a.pid.remote(), timeout=5) != old_pid:
                    break
            except Exception:  # still restarting
                pass
            await asyncio.sleep(0.2)
        second = ray.get(a.endpoint.remote())["url"]
        assert second != first
        await until(lambda: {(w.url, w.role) for w in registry.all()} == {(second, Role.DECODE)},
                    "the registry moved to the restarted actor's URL")
    finally:
        source.stop()
        ray.kill(a)
