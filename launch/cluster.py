"""A local cluster of OS processes: N prefill + M decode workers (or mixed workers) and a router.

Used by `pd-serve` and by tests that need to kill or restart one worker.
Children run ``python -m pd_cluster.launch.worker`` / ``python -m pd_cluster.router.main`` on free
loopback ports; their output is copied to ours with a ``[role-i]`` prefix. Every child gets
``PR_SET_PDEATHSIG`` (see `pd_cluster.launch.restarts`), so none outlives its launcher. With ``ClusterSpec.fork_workers``
(``pd-serve --fork-workers``) workers are forked from a zygote that imported their code once (`pd_cluster.launch.zygote`).

`LocalCluster.tend` is one step of supervision (``pd-serve`` calls it twice a second): a process that
exited is restarted on its port after a backoff, and a restarted worker is registered with the router
again once it answers ``/health``, so that the router checks it at once instead of at its next round.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from pd_cluster.common.net import free_port, port_taken
from pd_cluster.launch.kv_store import MASTER_NAME, STORE_NAME, plan_kv_store, wait_for_port
from pd_cluster.launch.placement import plan_gpus
from pd_cluster.launch.cluster_spec import (ADMIN_API_KEY_ENV, API_KEY_ENV, ClusterSpec, internal_key_env,
                                           worker_auth_argv, worker_ports)
from pd_cluster.launch import zygote
from pd_cluster.launch.restarts import RestartState, parent_bound_argv
from pd_cluster.launch.zygote import ForkedProcess

WORKER_ROLES = ("prefill", "decode", "mixed")
# One thread, alive as long as the process, forks every child (see `LocalCluster._spawn`).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-spawner")


@dataclass
class Proc:
    """One child process of the cluster."""

    name: str
    role: str
    url: str
    argv: list[str]
    popen: subprocess.Popen | ForkedProcess | None = None
    restarts: RestartState = field(default_factory=RestartState)

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None




class LocalCluster:
    """Starts, watches and stops the processes of a `ClusterSpec`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: list[Proc] = []
        self.logs: dict[str, deque[str]] = {}  # the last lines each process printed
        self.kv_store, self.engine_argv = plan_kv_store(spec.engine_argv, spec.kv_store_size)
        self.services = [] if self.kv_store is None else [  # started first, stopped last, never routed to
            Proc(MASTER_NAME, "kv-store", "", self.kv_store.master_argv()),
            Proc(STORE_NAME, "kv-store", "", self.kv_store.store_argv())]
        host = spec.host
        if spec.colocated:
            workers = [(f"mixed-{i}", "mixed") for i in range(spec.num_workers or spec.num_prefill + spec.num_decode)]
        else:
            workers = [(f"prefill-{i}", "prefill") for i in range(spec.num_prefill)]
            workers += [(f"decode-{i}", "decode") for i in range(spec.num_decode)]
        tp = spec.tp_size
        if spec.role_tp:
            tp = {r: spec.role_tp.get(r, spec.tp_size) for r in ("prefill", "decode", "mixed")}
        self.placement = plan_gpus(workers, tp, spec.num_gpus, spec.role_gpus, spec.mem_fraction_given)
        ports = worker_ports(workers, spec.role_ports, spec.router_port)
        for (name, role), port in zip(workers, ports):
            self._add_worker(name, role, port if port is not None else free_port(host))
        self.router_url = f"http://{host}:{spec.router_port}"
        router_argv = [sys.executable, "-m", "pd_cluster.router.main", "--host", host, "--port", str(spec.router_port),
                       "--log-level", spec.log_level]
        for role, flag in (("prefill", "--prefill"), ("decode", "--decode"), ("mixed", "--worker")):
            urls = [p.url for p in self.procs if p.role == role]
            if urls:
                router_argv += [flag, *urls]
        self.router = Proc("router", "router", self.router_url, router_argv + spec.router_argv)

    def _add_worker(self, name: str, role: str, port: int) -> None:
        url = f"http://{self.spec.host}:{port}"
        argv = [sys.executable, "-m", "pd_cluster.launch.worker", "--role", role, "--host", self.spec.host, "--port", str(port),
                "--advertise-url", url, "--log-level", self.spec.log_level, *self.engine_argv,
                *self.spec.role_argv.get(role, []), *self.placement.argv(name), *worker_auth_argv(self.spec)]
        prefill_urls = [q.url for q in self.procs if q.role == "prefill"]
        if role == "decode" and prefill_urls:  # the X-PD-Prefill-Url allow-list (prefill workers start first)
            argv += ["--prefill-urls", *prefill_urls]
        self.procs.append(Proc(name, role, url, argv))

    where = "on this machine"

    # ---- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Spawn every process; with `timeout`, also `wait_ready` until the router's ``/readiness`` is 200
        (``pd-serve``'s moment of "ready"; raises as `wait_ready` does).

        Raises:
            RuntimeError: the router's port is taken (checked before anything starts, so that ``pd-serve`` never
                reports ready while another server answers on its port).
        """
        reason = port_taken(self.spec.host, self.spec.router_port)
        if reason is not None:
            raise RuntimeError(f"the router cannot listen on {self.spec.host}:{self.spec.router_port} "
                               f"(port {self.spec.router_port}: {reason}); stop what uses it or pass another --port")
        for p in self.services:
            self._spawn(p)
        if self.kv_store is not None and not wait_for_port(self.kv_store.host, self.kv_store.master_port, 30):
            self._say(f"the KV store's master does not answer on {self.kv_store.address}; the workers start "
                      "without it and keep trying")
        for p in self.procs + [self.router]:
            self._spawn(p)
        if timeout is not None:
            self.wait_ready(timeout, every_worker=False)

    def dead(self) -> list[str]:
        """Names of the processes that exited."""
        return [p.name for p in self.procs + [self.router] + self.services if not p.alive()]

    def _spawn(self, p: Proc) -> None:
        """Start `p`, always from the cluster's own spawner thread.

        The kernel sends the parent-death signal when the *thread* that forked a child exits, so a child
        started from a short-lived thread (``asyncio.to_thread``, a pool) would be killed with it. The spawner
        thread lives as long as this process.
        """
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if p.role == "router":
            for var, key in ((API_KEY_ENV, self.spec.api_key), (ADMIN_API_KEY_ENV, self.spec.admin_api_key)):
                if key:
                    env[var] = key
        env.update(internal_key_env(self.spec))
        env.update(self.placement.env(p.name))
        forked = self.spec.fork_workers and p.role in WORKER_ROLES
        p.popen = _SPAWNER.submit(_start_child, p.argv, env, forked).result()
        p.restarts.started_at = time.monotonic()
        threading.Thread(target=self._pump, args=(p,), daemon=True).start()

    def _pump(self, p: Proc) -> None:
        assert p.popen is not None and p.popen.stdout is not None
        lines = self.logs.setdefault(p.name, deque(maxlen=50_000))
        for line in p.popen.stdout:
            lines.append(line)
            if self.spec.echo:
                sys.stdout.write(f"[{p.name}] {line}")
                sys.stdout.flush()

    def wait_ready(self, timeout: float = 300.0, every_worker: bool = True) -> None:
        """Block until every process answers ``/health`` and the router's ``/readiness`` is 200.

        The router's ``/readiness`` needs no key and is 200 once it can route a request (a healthy prefill
        and decode pair, or a mixed worker): the moment a request can succeed. With `every_worker` (tests
        that spread load over several workers), also until the router's ``/workers`` lists every worker
        healthy (with the admin key when there is one).

        Raises:
            RuntimeError: a process exited or `timeout` seconds passed.
        """
        deadline = time.monotonic() + timeout
        pending = list(self.procs) + [self.router]
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for p in list(pending):
                    if not p.alive():
                        time.sleep(0.3)  # let the output pump read the last lines
                        tail = "".join(list(self.logs.get(p.name, ()))[-20:])
                        raise RuntimeError(f"{p.name} exited with code {p.popen.poll()} during start-up; "
                                           f"its last lines:\n{tail}")
                    if _healthy(client, p):
                        pending.remove(p)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not ready after {timeout:.0f} s: {[p.name for p in pending]}")
                time.sleep(0.2)
            while not router_ready(client, self.router_url):
                if not self.router.alive():
                    raise RuntimeError(f"the router exited with code {self.router.popen.poll()} during start-up")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router's /readiness was not 200 after {timeout:.0f} s")
                time.sleep(0.1)
            while every_worker and not self._router_sees_every_worker(client):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router did not see every worker healthy after {timeout:.0f} s")
                time.sleep(0.1)

    def _router_sees_every_worker(self, client: httpx.Client) -> bool:
        headers = {"Authorization": f"Bearer {self.spec.admin_api_key}"} if self.spec.admin_api_key else {}
        try:
            r = client.get(self.router_url + "/workers", headers=headers)
            if r.status_code == 403:  # --api-key without --admin-api-key: the admin API is off
                return True
            healthy = {w["url"] for w in r.json()["workers"] if w["healthy"]}
            return {p.url for p in self.procs} <= healthy
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    # ---- supervision -------------------------------------------------------------
    def tend(self, now: float | None = None) -> bool:
        """One supervision step: note exits, restart what is due, re-register workers that answer again.

        Returns True when a process was restarted (its PID in `manifest` changed).
        """
        now = time.monotonic() if now is None else now
        changed = False
        for p in self.procs + [self.router] + self.services:
            r = p.restarts
            if p.popen is None or r.given_up:
                continue
            if not p.alive():
                if r.due is None:
                    self._on_exit(p, now)
                elif now >= r.due:
                    self._spawn(p)
                    r.on_restart(now)
                    changed = True
                    self._say(f"restarted {p.name} (pid {p.pid}, restart {r.total})")
            elif r.awaiting_health and self._answers(p):
                r.awaiting_health = False
                if p.role not in ("router", "kv-store"):
                    self._register(p)
                self._say(f"{p.name} is serving again ({p.url})")
        return changed

    def _on_exit(self, p: Proc, now: float) -> None:
        code = p.popen.poll()
        delay = p.restarts.on_exit(self.spec.restart, now)
        p.restarts.awaiting_health = False
        if p.role == "router":
            left = "no request is served until it is back"
        elif p.role == "kv-store":
            left = "the workers serve without the KV store until it is back"
        else:
            others = [q.name for q in self.procs if q.role == p.role and q is not p and q.alive()]
            left = (f"the router routes {p.role} work to {', '.join(others)}" if others else
                    f"no {p.role} worker is left: requests fail with 503 until one is back")
        plan = (f"restarting it in {delay:.1f} s" if delay is not None else
                f"giving up after {self.spec.restart.max_restarts} restarts in a row")
        self._say(f"{p.name} (pid {p.pid}) exited with code {code}; {left}; {plan}")

    def _answers(self, p: Proc) -> bool:
        if p.role == "kv-store":
            return p.alive()
        with httpx.Client(timeout=1.0) as client:
            if p.role == "router":
                return router_ready(client, p.url)
            return _healthy(client, p)

    def _register(self, p: Proc) -> None:
        """Register a restarted worker with the router again: its breaker and health state start afresh and
        the router checks it now (``DELETE`` then ``POST /workers``, with the admin key)."""
        headers = {"Authorization": f"Bearer {self.spec.admin_api_key}"} if self.spec.admin_api_key else {}
        try:
            with httpx.Client(timeout=5.0, headers=headers) as client:
                client.request("DELETE", self.router_url + "/workers", params={"url": p.url})
                r = client.post(self.router_url + "/workers", json={"url": p.url, "role": p.role})
            if r.status_code >= 400:
                self._say(f"the router refused to register {p.name} again ({r.status_code}: {r.text[:200]}); "
                          "it finds it at its next health check")
        except httpx.HTTPError as e:
            self._say(f"could not register {p.name} with the router ({e!r}); it finds it at its next health check")

    @staticmethod
    def _say(msg: str) -> None:
        print(f"pd-serve: {msg}", file=sys.stderr, flush=True)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one process (tests: a worker dying mid-request)."""
        p = self.by_name(name)
        if p.alive():
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:  # it exited a moment ago (a forked worker's exit is reported, not polled)
                pass
            p.popen.wait(10)

    def restart(self, name: str) -> None:
        """Start a killed process again, on the same port."""
        p = self.by_name(name)
        if p.alive():
            raise RuntimeError(f"{name} is still running")
        self._spawn(p)

    def by_name(self, name: str) -> Proc:
        return next(p for p in self.procs + [self.router] + self.services if p.name == name)

    def stop(self, timeout: float = 15.0, force: threading.Event | None = None) -> None:
        """Drain, then stop: the router first, the workers once it has exited.

        The router gets SIGTERM: it stops taking requests and lets those in flight (streams included) finish for
        up to its ``--shutdown-grace-period-secs`` (`ClusterSpec.shutdown_grace_period_secs`), then exits. The
        workers keep serving those requests meanwhile, and get SIGTERM only once the router is gone; each has
        `timeout` seconds to exit. Whatever is still running after its wait is SIGKILLed, and so is everything
        once `force` is set (a second Ctrl-C).
        """
        signal_all([self.router], signal.SIGTERM)
        wait_or_kill([self.router], self.spec.shutdown_grace_period_secs + timeout, force, self._say)
        signal_all(self.procs, signal.SIGTERM)
        wait_or_kill(self.procs, timeout, force, self._say)
        for p in reversed(self.services):  # the store's memory first, then its master
            signal_all([p], signal.SIGTERM)
            wait_or_kill([p], timeout, force, self._say)

    @property
    def manifest(self) -> dict:
        """URLs and PIDs of every process (`pd-serve --manifest` writes this as JSON)."""
        return {"router": {"url": self.router_url, "pid": self.router.pid, "restarts": self.router.restarts.total},
                "workers": [{"name": p.name, "role": p.role, "url": p.url, "pid": p.pid,
                             "restarts": p.restarts.total} for p in self.procs]}

    def write_manifest(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.manifest, f, indent=2)


def signal_all(procs: list[Proc], sig: int) -> None:
    """Send `sig` to the process group of every one of `procs` still running."""
    for p in procs:
        if p.alive():
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:
                pass


def wait_or_kill(procs: list[Proc], timeout: float, force: threading.Event | None, say=print) -> None:
    """Wait until every one of `procs` exited, `timeout` seconds passed or `force` is set; SIGKILL the rest (and
    `say` which)."""
    deadline = time.monotonic() + timeout
    while any(p.alive() for p in procs) and time.monotonic() < deadline and not (force and force.is_set()):
        time.sleep(0.05)
    left = [p for p in procs if p.alive()]
    if left:
        say(f"killing {', '.join(p.name for p in left)} (still running after the drain)")
    signal_all(left, signal.SIGKILL)
    for p in procs:
        if p.popen is not None:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass




def _start_child(argv: list[str], env: dict[str, str], forked: bool) -> subprocess.Popen | ForkedProcess:
    """Start `argv` bound to this process (runs on the spawner thread): forked from a zygote when `forked` and it
    can be, else a new interpreter."""
    child = zygote.spawn(argv, env, parent_bound_argv) if forked else None
    if child is None:
        child = subprocess.Popen(parent_bound_argv(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, text=True, errors="replace")
    return child


def _healthy(client: httpx.Client, p: Proc) -> bool:
    try:
        return client.get(p.url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def router_ready(client: httpx.Client, url: str) -> bool:
    """True when the router at `url` answers ``/readiness`` with 200 (no key needed)."""
    try:
        return client.get(url + "/readiness").status_code == 200
    except httpx.HTTPError:
        return False
