"""The router's startup probe on real processes: a 1P1D `LocalCluster` whose router checks health only every 60 s
(``--health-check-interval-secs 60``) is ready long before that, because workers never seen ready are checked every
`STARTUP_PROBE_SECS` (`router/health.py`); and it serves. The bound (30 s) is loose: a worker of the embedded model
starts in about 5 s on a quiet 2-core machine, and without the probe the router would wait for its 60 s round."""

from __future__ import annotations

import time

import httpx
import pytest
from cluster_util import running_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_cold_cluster_is_ready_before_the_routers_first_health_round():
    started = time.monotonic()
    with running_cluster(1, 1, router_argv=["--health-check-interval-secs", "60"]) as cluster:
        ready_after = time.monotonic() - started
        assert ready_after < 30, f"ready after {ready_after:.1f} s"
        r = httpx.post(cluster.router_url + "/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
