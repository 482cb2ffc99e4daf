"""``pd-serve --ray-address ADDR``: the router and the prefill/decode workers as Ray actors.

Each worker is a named actor (``pd-worker-<role>-<i>`` in a Ray namespace made
for this run) holding one placement group: a single bundle on one node with
the instance's GPUs, so by default one prefill or decode instance takes a whole
8-GPU node (``--tp-size N`` reserves N GPUs instead). The actor starts
``python -m pd_cluster.launch.worker`` on its node as a child process, on the node's IP and
a free port, and answers ``endpoint()`` with ``{"url", "role"}``: the contract of
the router's Ray discovery (``router/discovery/ray.py``). The router is an actor
on the driver's node that runs ``python -m pd_cluster.router.main --ray-discovery``.

``--ray-address local`` starts a Ray instance on this machine with CPU
resources only and runs the same cluster there (servers on ``--host``); Ctrl-C
stops the router, then the workers, removes the placement groups and shuts the
local instance down, leaving no Ray process behind. Any other address
(``auto``, ``host:6379``, ``ray://host:10001``) joins an existing cluster.

Children are stopped with SIGINT, which both servers treat like SIGTERM (a
graceful drain); in the router, a Ray driver, Ray's native signal handler takes
SIGTERM and ends the process without draining. Children also get
``PR_SET_PDEATHSIG`` (Linux): if Ray kills an actor, its child gets SIGINT and
drains instead of lingering.
The placement approach follows Ray's placement-group API (docs.ray.io,
"Placement Groups"); the actor contract is the one of ``docs/router.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import httpx

from pd_cluster.common.net import free_port
from pd_cluster.launch.cluster import router_ready
from pd_cluster.launch.cluster_spec import (ADMIN_API_KEY_ENV, API_KEY_ENV, ClusterSpec, internal_key_env,
                                           worker_auth_argv)
from pd_cluster.launch.restarts import parent_bound_argv
from pd_cluster.launch.supervise import serve_until_stopped

ACTOR_PREFIX = "pd-worker"
GPUS_PER_NODE_DEFAULT = 8
STOP_TIMEOUT_S = 20.0
@dataclass(frozen=True)
class RayPlacement:
    """What one worker instance reserves: one bundle, packed on one node.

    Attributes:
        gpus_per_worker: GPUs in the bundle (0 on CPU-only clusters).
        cpus_per_worker: logical CPUs in the bundle.
        strategy: the placement-group strategy (``STRICT_PACK``: the bundle's GPUs on one node).
    """

    gpus_per_worker: int = 0
    cpus_per_worker: float = 1.0
    strategy: str = "STRICT_PACK"

    def __post_init__(self) -> None:
        if self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            raise ValueError(f"bad placement: {self.gpus_per_worker} GPUs, {self.cpus_per_worker} CPUs")

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            out["GPU"] = float(self.gpus_per_worker)
        return out


def plan_placement(tp_size: int | None, node_gpus: list[float]) -> RayPlacement:
    """GPUs per instance: ``tp_size`` when given, else a whole node up to 8 GPUs; none without GPUs.

    Raises:
        ValueError: ``tp_size`` GPUs do not fit on any node.
    """
    largest = int(max(node_gpus, default=0))
    if largest == 0:
        return RayPlacement(0)
    gpus = tp_size or min(GPUS_PER_NODE_DEFAULT, largest)
    if gpus > largest:
        raise ValueError(f"--tp-size {gpus} needs {gpus} GPUs on one node; the largest node has {largest}")
    return RayPlacement(gpus)


def worker_argv(role: str, host: str, port: int, spec: ClusterSpec) -> list[str]:
    """``pd-worker`` arguments of one instance, as `launch.cluster.LocalCluster` builds them."""
    return ["--role", role, "--host", host, "--port", str(port), "--advertise-url", f"http://{host}:{port}",
            "--log-level", spec.log_level, *spec.engine_argv, *spec.role_argv.get(role, []), *worker_auth_argv(spec)]


def router_argv(spec: ClusterSpec, gcs_address: str, namespace: str) -> list[str]:
    """``pd-router`` arguments: discovery of this run's named worker actors, the workers' tokenizer folder (as
    `LocalCluster` passes it, unless the user's flags name one), then the user's flags."""
    return ["--host", spec.host, "--port", str(spec.router_port), "--log-level", spec.log_level,
            "--ray-discovery", "--ray-address", gcs_address, "--ray-namespace", namespace,
            "--ray-actor-prefix", ACTOR_PREFIX, "--ray-poll-secs", "1",
            *spec.router_argv]


class ProcessActor:
    """A Ray actor that runs one pd-cluster process (a worker or the router) as its child.

    The child starts in ``__init__`` (the actor's main thread, so the parent-death
    signal follows the actor process). ``{host}`` and ``{port}`` in `argv_template`
    are replaced by `host` (None: this node's IP) and `port` (None: a free port there).
    """

    def __init__(self, name: str, role: str, module: str, argv_template: list[str], host: str | None,
                 port: int | None = None, env: dict[str, str] | None = None) -> None:
        import ray

        self.name, self.role = name, role
        self.host = host or ray.util.get_node_ip_address()
        port = port or free_port(self.host)
        argv = [a.replace("{host}", self.host).replace("{port}", str(port)) for a in argv_template]
        self.url = f"http://{self.host}:{port}"
        cmd = parent_bound_argv([sys.executable, "-m", module, *argv], signal.SIGINT)
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                                     start_new_session=True)
        self._stopping = False
        threading.Thread(target=self._exit_with_child, name="child-watch", daemon=True).start()

    def _exit_with_child(self) -> None:
        """The child exited without `stop`: end this actor's process too, so Ray restarts the actor (its
        ``max_restarts``), which runs ``__init__`` again and with it a fresh child (Ray's fault-tolerance
        guide, "Actor process failure")."""
        code = self.proc.wait()
        if not self._stopping:
            print(f"{self.name}: its process exited with code {code}; ending the actor so Ray restarts it",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def __repr__(self) -> str:  # Ray prefixes the child's log lines with this
        return self.name

    def endpoint(self) -> dict[str, str]:
        """``{"url", "role"}``: what the router's Ray discovery reads."""
        return {"url": self.url, "role": self.role}

    def info(self) -> dict:
        import ray

        return {"name": self.name, "role": self.role, "url": self.url, "pid": self.proc.pid,
                "node": ray.get_runtime_context().get_node_id()}

    def returncode(self) -> int | None:
        """None while the child runs, else its exit code."""
        return self.proc.poll()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGINT the child (it drains), SIGKILL it after `timeout` seconds; returns its exit code."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


class RayCluster:
    """Places and supervises the actors of one `ClusterSpec` on a Ray cluster."""

    def __init__(self, address: str, spec: ClusterSpec, tp_size: int | None) -> None:
        self.address, self.spec, self.tp_size = address, spec, tp_size
        self.local = address == "local"
        self.where = "on a local Ray instance (CPU)" if self.local else f"on Ray at {address}"
        self.namespace = f"pd-cluster-{uuid.uuid4().hex[:8]}"
        self.workers: list = []
        self.names: list[str] = []
        self.groups: list = []
        self.router = None
        self.manifest: dict = {}
        self._reported: set[str] = set()
        self._restarts: dict[str, int] = {}
        self._actor_cls = None  # `ProcessActor` as a Ray actor class (set by `start`)
        self._gpus_per_worker = 0.0

    @property
    def router_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.router_port}"

    def roles(self) -> list[str]:
        s = self.spec
        if s.colocated:
            return ["mixed"] * (s.num_workers or s.num_prefill + s.num_decode)
        return ["prefill"] * s.num_prefill + ["decode"] * s.num_decode

    def max_local_workers(self) -> int:
        """Workers a local Ray instance makes CPU slots for: the launch's."""
        return len(self.roles())

    def connect(self):
        import ray

        if self.local:  # CPU slots: one per worker (`max_local_workers`) and one for the router
            ray.init(num_cpus=self.max_local_workers() + 1, num_gpus=0, namespace=self.namespace,
                     include_dashboard=False, log_to_driver=self.spec.echo, object_store_memory=128 * 2**20)
        else:
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=self.spec.echo)
        return ray

    def start(self, timeout: float) -> None:
        """Reserve, place and start every actor; return once the router routes to all workers.

        Raises:
            RuntimeError: a placement group, a process or the router was not ready within `timeout` s.
        """
        ray = self.connect()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        deadline = time.monotonic() + timeout
        self._actor_cls = ray.remote(max_restarts=self.spec.restart.max_restarts)(ProcessActor)  # -1: forever too
        counts: dict[str, int] = {}
        for role in self.roles():
            counts[role] = counts.get(role, -1) + 1
            self.add_actor(*self.place_worker(role, counts[role], deadline))
        gcs = ray.get_runtime_context().gcs_address
        self.router = self._actor_cls.options(
            name="pd-router", num_cpus=1 if self.local else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote("pd-router", "router", "pd_cluster.router.main", router_argv(self.spec, gcs, self.namespace),
                 self.spec.host, self.spec.router_port, _key_env(self.spec))
        infos = ray.get([a.info.remote() for a in self.workers + [self.router]])
        self._wait_ready(ray, infos, deadline)
        self.manifest = {"router": {"url": self.router_url, "pid": infos[-1]["pid"]},
                         "workers": [dict(i, restarts=0) for i in infos[:-1]],
                         "ray": {"address": gcs, "namespace": self.namespace, "local": self.local,
                                 "session_dir": _session_dir(ray), "gpus_per_worker": self._gpus_per_worker}}

    def add_actor(self, name: str, actor, pg) -> None:
        """Note a worker actor and its placement group (`place_worker`'s) in the lists `tend` and `stop` read."""
        self.groups, self.names, self.workers = self.groups + [pg], self.names + [name], self.workers + [actor]

    def place_worker(self, role: str, index: int, deadline: float) -> tuple:
        """Reserve a placement group for worker ``<role>-<index>`` and start its actor: (name, handle, group).
        RuntimeError when no node had the resources by `deadline` or the actor failed (the group is removed)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node_gpus = [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
        placement = plan_placement(self.spec.role_tp.get(role, self.tp_size), node_gpus)
        self._gpus_per_worker = placement.gpus_per_worker
        name = f"{ACTOR_PREFIX}-{role}-{index}"
        pg = placement_group([placement.bundle()], strategy=placement.strategy, name=f"{self.namespace}-{name}")
        if not _wait_ref(ray, pg.ready(), deadline):
            remove_placement_group(pg)
            raise RuntimeError(f"{name}: no node has {placement.bundle()} free (cluster: "
                               f"{ray.cluster_resources()})")
        host = self.spec.host if self.local else None
        try:
            actor = self._actor_cls.options(
                name=name, num_cpus=placement.cpus_per_worker, num_gpus=placement.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(name, role, "pd_cluster.launch.worker", worker_argv(role, "{host}", "{port}", self.spec), host,
                     None, internal_key_env(self.spec))
        except Exception as e:
            remove_placement_group(pg)
            raise RuntimeError(f"{name}: {e}") from e
        return name, actor, pg

    def _wait_ready(self, ray, infos: list[dict], deadline: float, actors: list | None = None,
                    router: bool = True) -> None:
        """Until each of `actors` (default: workers, router) answers ``/health``, then (`router`) the router's
        ``/readiness``; RuntimeError when a process exited or `deadline` passed."""
        actors = self.workers + [self.router] if actors is None else actors
        pending = {i["url"]: (i, actor) for i, actor in zip(infos, actors)}
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for url, (info, actor) in list(pending.items()):
                    code = ray.get(actor.returncode.remote())
                    if code is not None:
                        raise RuntimeError(f"{info['name']} exited with code {code} during start-up")
                    try:
                        if client.get(url + "/health").status_code == 200:
                            del pending[url]
                    except httpx.HTTPError:
                        pass
                _check_deadline(deadline, f"not healthy: {[i['name'] for i, _ in pending.values()]}")
                time.sleep(0.5)
            while router and not router_ready(client, self.router_url):
                _check_deadline(deadline, "the router's /readiness was never 200")
                time.sleep(0.2)

    def actors(self) -> list[tuple[str, object]]:
        """(name, handle) of every actor started so far, the router last."""
        out = list(zip(self.names, self.workers))
        return out + ([("pd-router", self.router)] if self.router is not None else [])

    def dead(self) -> list[str]:
        """Names of actors whose process has exited, or that are gone themselves."""
        import ray

        out = []
        for name, actor in self.actors():
            try:
                if ray.get(actor.returncode.remote(), timeout=10) is not None:
                    out.append(name)
            except Exception:  # the actor died (its child got the parent-death signal)
                out.append(name)
        return out

    def tend(self) -> bool:
        """Note actors that Ray restarted (a new process, hence a new pid and URL) in the manifest.

        Ray restarts an actor whose process died, up to ``--max-restarts`` times (`ProcessActor` ends itself
        when its child exits); the router's Ray discovery sees the new URL under the same actor name. Actors
        that answer nothing (restarting, or out of restarts) are reported once each.

        Returns:
            True when the manifest changed.
        """
        import ray

        changed = False
        workers = self.manifest.get("workers", [])
        entry = {w["name"]: k for k, w in enumerate(workers)}  # an actor still starting has none yet
        refs = [(entry.get(name), name, actor.info.remote()) for name, actor in zip(self.names, self.workers)]
        for i, name, ref in refs:
            try:
                info = ray.get(ref, timeout=5)
            except Exception:  # restarting, or dead for good
                if name not in self._reported:
                    self._reported.add(name)
                    print(f"pd-serve: {name} is down; Ray restarts it while it has restarts left",
                          file=sys.stderr, flush=True)
                continue
            self._reported.discard(name)
            if i is not None and (info["pid"], info["url"]) != (workers[i]["pid"], workers[i]["url"]):
                self._restarts[name] = self._restarts.get(name, 0) + 1
                workers[i] = dict(info, restarts=self._restarts[name])
                print(f"pd-serve: {name} restarted by Ray (pid {info['pid']}, {info['url']}, restart "
                      f"{self._restarts[name]})", file=sys.stderr, flush=True)
                changed = True
        return changed

    def stop(self) -> None:
        """Router first (no new requests), then the workers; then the actors, the groups and a local Ray."""
        import ray

        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        actors = self.actors()
        for batch in (actors[-1:] if self.router is not None else [], actors[:len(self.workers)]):
            refs = {name: actor.stop.remote() for name, actor in batch}
            for name, ref in refs.items():
                try:
                    ray.get(ref, timeout=STOP_TIMEOUT_S + 10)
                except Exception as e:  # the actor is gone already: its child got the parent-death signal
                    print(f"pd-serve: {name} was already gone ({type(e).__name__})", file=sys.stderr)
        for _, actor in actors:
            ray.kill(actor)
        for pg in self.groups:
            remove_placement_group(pg)
        ray.shutdown()


def _key_env(spec: ClusterSpec) -> dict[str, str]:
    """The router's keys and the cluster's internal key, for its environment (never its command line)."""
    keys = {API_KEY_ENV: spec.api_key, ADMIN_API_KEY_ENV: spec.admin_api_key}
    return dict({var: key for var, key in keys.items() if key}, **internal_key_env(spec))


def _wait_ref(ray, ref, deadline: float) -> bool:
    ready, _ = ray.wait([ref], timeout=max(deadline - time.monotonic(), 0.1))
    return bool(ready)


def _check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(what)


def _session_dir(ray) -> str | None:
    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_session_dir_path() if node is not None else None


def run_ray_cluster(address: str, spec: ClusterSpec, args: argparse.Namespace,
                    cluster: RayCluster | None = None) -> int:
    """Run `spec` on Ray until SIGINT/SIGTERM (`cluster`: a `RayCluster` of the caller's instead, such as
    ``--autoscale``'s `pd_cluster.launch.ray_autoscale.AutoscaledRayCluster`); 0 on a clean stop, 1 when start-up
    failed (``pd-serve`` entry)."""
    cluster = cluster or RayCluster(address, spec, getattr(args, "tp_size", None))
    return serve_until_stopped(cluster, getattr(args, "startup_timeout", 300.0), getattr(args, "manifest", None),
                               spec.api_key)
