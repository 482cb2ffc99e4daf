"""Processes for router tests: the real ``pd-router`` and PD-aware fake workers.

Everything listens on 127.0.0.1 on ports chosen free at run time; each
process is killed on ``stop()`` or at the end of its ``with`` block.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pd_cluster.common.net import free_port  # noqa: F401  (used by the router tests)

REPO = Path(__file__).resolve().parents[2]
_LOGS = Path(tempfile.mkdtemp(prefix="router-testkit-"))  # the children's logs, removed when this process exits
atexit.register(shutil.rmtree, _LOGS, True)


def wait_http(url: str, timeout: float, ok=lambda r: r.status_code == 200) -> httpx.Response:
    """Poll ``url`` until ``ok(response)``; raises ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=1.0)
            if ok(r):
                return r
            last = r.status_code
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout} s (last: {last!r})")


class Proc:
    """A child process with its output in a temporary log file."""

    def __init__(self, cmd: list[str], name: str) -> None:
        self.cmd = cmd
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=_LOGS)[1])

    def start(self) -> "Proc":
        # Keep the caller's PYTHONPATH after the repo: it may point ``pd_cluster`` at this tree.
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills after ``timeout``)."""
        if not self.alive:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.kill()
        if hasattr(self, "_log"):
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FakeWorker(Proc):
    """``tests.router.pd_fake`` on a fixed port (so a restart keeps its URL)."""

    def __init__(self, role: str, args: list[str] = (), port: int | None = None) -> None:
        self.port = port or free_port()
        self.role = role
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        super().__init__([sys.executable, "-m", "tests.router.pd_fake", "--host", "127.0.0.1",
                          "--port", str(self.port), "--role", role, *self.args], f"fake-{role}")

    def start(self, timeout: float = 30.0) -> "FakeWorker":
        super().start()
        wait_http(self.url + "/health", timeout)
        return self

    def restart(self, timeout: float = 30.0) -> "FakeWorker":
        self.kill()
        return self.start(timeout)

    def recent(self) -> list[dict]:
        return httpx.get(self.url + "/debug/requests", timeout=5).json()

    def __enter__(self) -> "FakeWorker":
        return self.start()


class RouterProc(Proc):
    """``python -m pd_cluster.router.main`` on a free port; ready when ``/readiness`` is 200."""

    def __init__(self, args: list[str], port: int | None = None, ready: str = "/readiness") -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_path = ready
        super().__init__([sys.executable, "-m", "pd_cluster.router.main", "--host", "127.0.0.1",
                          "--port", str(self.port), *args], "router")

    def start(self, timeout: float = 60.0) -> "RouterProc":
        super().start()
        try:
            wait_http(self.url + self.ready_path, timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"router did not become ready:\n{self.log()[-4000:]}") from None
        return self

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def __enter__(self) -> "RouterProc":
        return self.start()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@dataclass
class StubCandidate:
    """A worker as a policy sees it (`router.policies.base.Candidate`), for policy tests without a registry."""

    url: str
    load: object = None
    inflight: int = 0
    sent_since_report: int = 0
