"""A freshly started 1P2D cluster under CPU starvation serves its first burst whole.

Busy-loop processes (started and stopped by pid here) take most of this 2-core machine while a 1P2D cluster
starts and its first burst of concurrent streams arrives. Before, the first contacts of that burst (each decode
worker's first ``/kv_transfer/info`` fetch and handshake with the prefill worker, and back) timed out on the
starved event loops: streams failed with ``502 kv_transfer_metadata_unreachable`` or ``worker_dead`` and
breakers opened, though no worker had died. Now each decode worker meets its prefill worker both ways before it
reports ready, every internal call retries slowness within the request's deadline, and a slow worker is never
taken for a dead one: every stream equals the offline greedy text, no breaker opens, no worker is found dead.
"""

from __future__ import annotations

import pytest
from cluster_util import PROMPTS, running_cluster
from overload_kit import burst, references, router_counts

from pd_cluster.bench.scripts.cpu_hogs import cpu_hogs, load_average

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HOGS = 12
STREAMS = 48
MAX_TOKENS = 16


def test_a_cold_1p2d_cluster_under_cpu_hogs_serves_its_first_burst_exactly():
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(STREAMS)]
    want = references(prompts, MAX_TOKENS)
    bodies = {f"cold-{i}": {"model": "stories260K", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True} for i, p in enumerate(prompts)}
    with cpu_hogs(HOGS):
        with running_cluster(1, 2) as cluster:
            got = burst(cluster.router_url, bodies)
            counts = router_counts(cluster.router_url)
            load = load_average()
    failed = {rid: r["error"] for rid, r in got.items() if r["error"] or not r["done"]}
    wrong = [rid for rid, r in got.items() if not r["error"] and r["texts"].get(0) != want[bodies[rid]["prompt"]]]
    print(f"\nload {load:.1f}; {counts}")
    assert not failed, failed
    assert not wrong, wrong
    assert counts["breakers_opened"] == 0 and counts["deaths"] == 0 and counts["inflight_failed"] == 0, counts
