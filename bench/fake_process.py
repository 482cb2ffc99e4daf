"""Start fake OpenAI workers (``pd_cluster.bench.fake_server``) as separate OS processes.

Used by tests and benchmark scripts so the fake runs on its own core and its
timing is not disturbed by the client under test::

    with FakeServerProcess(["--ttft-ms", "50", "--itl-ms", "10", "--num-tokens", "20"]) as fake:
        httpx.get(fake.url + "/health")
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque


class FakeServerProcess:
    """A ``python -m pd_cluster.bench.fake_server --port 0 ARGS...`` child process.

    ``url`` is ``http://127.0.0.1:PORT`` once started (the port is picked by the
    OS and read from the child's output). The child is killed on :meth:`stop` or
    when the ``with`` block ends. ``realtime`` passes ``--realtime`` (SCHED_FIFO
    when permitted, so the fake's delays stay exact on a loaded machine);
    ``scheduling`` then says what the child got.

    Raises ``RuntimeError`` when the child exits or stays silent for
    ``start_timeout`` seconds.
    """

    def __init__(self, args: list[str] | tuple[str, ...] = (), start_timeout: float = 30.0,
                 realtime: bool = False) -> None:
        self.args = list(args) + (["--realtime"] if realtime else [])
        self.scheduling = "normal"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.output: deque[str] = deque(maxlen=200)

    def start(self) -> "FakeServerProcess":
        cmd = [sys.executable, "-m", "pd_cluster.bench.fake_server", "--host", "127.0.0.1", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake server did not start: {' '.join(self.output)}")
        return self

    def _pump(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            if "scheduling: " in line:
                self.scheduling = line.split("scheduling: ", 1)[1].strip()
            if not ready.is_set() and "listening on " in line:
                self.url = line.rsplit("listening on ", 1)[1].strip()
                ready.set()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "FakeServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
