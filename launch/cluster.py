"""A local cluster of OS processes: N prefill + M decode workers (or mixed workers) and a router.

Used by `pd-serve` and by tests that need to kill or restart one worker.
Children run ``python -m pd_cluster.launch.worker`` / ``python -m pd_cluster.router.main`` on free
loopback ports; their output is copied to ours with a ``[role-i]`` prefix.
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
from dataclasses import dataclass, field

import httpx

from pd_cluster.engine.net import free_port


@dataclass
class Proc:
    """One child process of the cluster."""

    name: str
    role: str
    url: str
    argv: list[str]
    popen: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class ClusterSpec:
    """What to start.

    Attributes:
        num_prefill, num_decode: PD workers (ignored when `colocated`).
        colocated: start `num_workers` mixed workers instead.
        engine_argv: engine/transfer flags passed to every worker.
        role_argv: extra flags for the workers of one role (``{"prefill": [...]}``), after `engine_argv`.
        router_argv: extra router flags.
    """

    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    num_workers: int = 0
    host: str = "127.0.0.1"
    router_port: int = 8000
    engine_argv: list[str] = field(default_factory=list)
    role_argv: dict[str, list[str]] = field(default_factory=dict)
    router_argv: list[str] = field(default_factory=list)
    log_level: str = "info"
    echo: bool = True


class LocalCluster:
    """Starts, watches and stops the processes of a `ClusterSpec`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: list[Proc] = []
        self.logs: dict[str, deque[str]] = {}  # the last lines each process printed
        host = spec.host
        if spec.colocated:
            for i in range(spec.num_workers or spec.num_prefill + spec.num_decode):
                self._add_worker(f"mixed-{i}", "mixed", free_port(host))
        else:
            for i in range(spec.num_prefill):
                self._add_worker(f"prefill-{i}", "prefill", free_port(host))
            for i in range(spec.num_decode):
                self._add_worker(f"decode-{i}", "decode", free_port(host))
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
                "--advertise-url", url, "--log-level", self.spec.log_level, *self.spec.engine_argv,
                *self.spec.role_argv.get(role, [])]
        self.procs.append(Proc(name, role, url, argv))

    where = "on this machine"

    # ---- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Spawn every process; with `timeout`, also `wait_ready` (raises as it does)."""
        for p in self.procs + [self.router]:
            self._spawn(p)
        if timeout is not None:
            self.wait_ready(timeout)

    def dead(self) -> list[str]:
        """Names of the processes that exited."""
        return [p.name for p in self.procs + [self.router] if not p.alive()]

    def _spawn(self, p: Proc) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p.popen = subprocess.Popen(p.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True, text=True, errors="replace")
        threading.Thread(target=self._pump, args=(p,), daemon=True).start()

    def _pump(self, p: Proc) -> None:
        assert p.popen is not None and p.popen.stdout is not None
        lines = self.logs.setdefault(p.name, deque(maxlen=50_000))
        for line in p.popen.stdout:
            lines.append(line)
            if self.spec.echo:
                sys.stdout.write(f"[{p.name}] {line}")
                sys.stdout.flush()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until every worker and the router answer ``/health`` and the router knows the model.

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
            while not (_router_sees_all_healthy(client, self.router_url, len(self.procs))
                       and _router_has_model(client, self.router_url)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the router never saw every worker healthy")
                time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one process (tests: a worker dying mid-request)."""
        p = self.by_name(name)
        if p.alive():
            os.killpg(p.popen.pid, sig)
            p.popen.wait(10)

    def restart(self, name: str) -> None:
        """Start a killed process again, on the same port."""
        p = self.by_name(name)
        if p.alive():
            raise RuntimeError(f"{name} is still running")
        self._spawn(p)

    def by_name(self, name: str) -> Proc:
        return next(p for p in self.procs + [self.router] if p.name == name)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM everything (router first, so it stops taking requests), then SIGKILL what remains."""
        order = [self.router] + self.procs
        for p in order:
            if p.alive():
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in order:
            if p.popen is None:
                continue
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(5)

    @property
    def manifest(self) -> dict:
        """URLs and PIDs of every process (`pd-serve --manifest` writes this as JSON)."""
        return {"router": {"url": self.router_url, "pid": self.router.pid},
                "workers": [{"name": p.name, "role": p.role, "url": p.url, "pid": p.pid} for p in self.procs]}

    def write_manifest(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.manifest, f, indent=2)


def _healthy(client: httpx.Client, p: Proc) -> bool:
    try:
        return client.get(p.url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _router_sees_all_healthy(client: httpx.Client, url: str, n: int) -> bool:
    try:
        workers = client.get(url + "/workers").json()["workers"]
        return len(workers) >= n and all(w["healthy"] for w in workers)
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def _router_has_model(client: httpx.Client, url: str) -> bool:
    try:
        r = client.get(url + "/v1/models")
        return r.status_code == 200 and bool(r.json().get("data"))
    except (httpx.HTTPError, ValueError):
        return False
