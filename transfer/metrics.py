"""Prometheus metrics of the KV transfer path (names from ``docs/worker-api.md``).

The metrics live on a registry the caller passes in, so several agents in one
process (tests, benchmarks) do not collide, and the worker serves its own
registry at ``/metrics``. Names follow SGLang's (``sglang:`` -> ``pd:``) and
vLLM's NIXL connector for the same concepts.

Speed is the bytes of a push (the sum of its descriptor lengths, all of which
NIXL reported done) over the time from just before the post call to the
completion being observed: a push that completes inside the post (a
shared-memory copy) is timed by the post itself, one that completes later by
the next `poll`. The latency can only be overestimated and the speed
underestimated, so it never exceeds the link rate (a speed metric above line
rate was a complaint about other systems).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
_SPEED_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 50.0, 100.0, 200.0, 400.0)
_DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class TransferMetrics:
    """The transfer metrics of one worker.

    Args:
        registry: where to register them (the worker's; a fresh one in tests).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Counter("pd:kv_transfer_bytes", "KV bytes moved by NIXL", registry=registry)
        self.latency = Histogram("pd:kv_transfer_latency_seconds", "per transfer (one push), post to completion",
                                 buckets=_LATENCY_BUCKETS, registry=registry)
        self.speed = Histogram("pd:kv_transfer_speed_gb_s", "per transfer, bytes moved / its latency, GB/s (10^9)",
                               buckets=_SPEED_BUCKETS, registry=registry)
        self.num_descriptors = Histogram("pd:kv_transfer_num_descriptors", "NIXL descriptors per transfer",
                                         buckets=_DESC_BUCKETS, registry=registry)
        self.received_bytes = Counter("pd:kv_transfer_received_bytes",
                                      "decode: KV bytes of pushes that arrived (a delta transfer's only)",
                                      registry=registry)
        self.failed = Counter("pd:kv_transfer_failed", "failed transfers", ["reason"], registry=registry)
        self.decode_transfer_queue = Gauge("pd:num_decode_transfer_queue_reqs",
                                           "decode: requests waiting for their KV", registry=registry)
        self.prefill_inflight_queue = Gauge("pd:num_prefill_inflight_queue_reqs",
                                            "prefill: prefilled jobs whose pushes are in flight", registry=registry)

    def observe_push(self, nbytes: int, seconds: float, num_descs: int) -> None:
        """Record one completed push."""
        self.bytes.inc(nbytes)
        self.latency.observe(seconds)
        self.num_descriptors.observe(num_descs)
        if seconds > 0:
            self.speed.observe(nbytes / seconds / 1e9)

    def observe_failure(self, reason: str) -> None:
        self.failed.labels(reason=reason).inc()
