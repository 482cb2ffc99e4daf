"""A worker stopped by SIGINT or SIGTERM drains and exits 0, without a traceback (uvicorn re-raises the captured
signal after its graceful shutdown unless the server says the drain answered it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pd_cluster.common.net import free_port

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_worker_exits_0_after_the_drain_a_signal_started(sig):
    port = free_port()
    cmd = [sys.executable, "-m", "pd_cluster.launch.worker", "--role", "mixed", "--port", str(port),
           "--cpu-threads", "1", "--kv-cache-memory", "16MiB", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the worker exited during start-up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "worker not healthy within 120 s"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4})
        assert r.status_code == 200
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "Shutting down" in err, err[-2000:]
