"""The fake server's own measurements, exposed under the ``pd:`` names of ``docs/worker-api.md``.

Every value is measured on the fake itself with ``time.monotonic()`` around
the phases it emulates (queue, prefill, KV transfer, decode) or counted from
what it actually sent, so a scraper can be checked against known numbers.
Each server owns its own :class:`prometheus_client.CollectorRegistry`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets in seconds (SGLang's shape, plus fine steps below 50 ms so tests can
# check percentiles of a fake with millisecond delays).
LATENCY_BUCKETS = (
    0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
)
SPEED_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
DESC_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class FakeMetrics:
    """Prometheus metrics of one fake worker (names: ``docs/worker-api.md``)."""

    def __init__(self, max_total_num_tokens: int, prefix_cache: bool = False) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        # Gauges whose value is computed at scrape time are bound by the server.
        self.num_running_reqs = Gauge("pd:num_running_reqs", "requests in the running batch", registry=r)
        self.num_queue_reqs = Gauge("pd:num_queue_reqs", "requests waiting for admission", registry=r)
        self.token_usage = Gauge("pd:token_usage", "used KV pages / all pages", registry=r)
        Gauge("pd:max_total_num_tokens", "pool capacity in tokens", registry=r).set(max_total_num_tokens)
        self.gen_throughput = Gauge("pd:gen_throughput", "generated tokens/s over the last interval", registry=r)
        self.prefill_bootstrap = Gauge("pd:num_prefill_bootstrap_queue_reqs", "prefill bootstrap queue", registry=r)
        self.prefill_inflight = Gauge("pd:num_prefill_inflight_queue_reqs", "prefill in-flight pushes", registry=r)
        self.decode_prealloc = Gauge("pd:num_decode_prealloc_queue_reqs", "decode waiting for pages", registry=r)
        self.decode_transfer = Gauge("pd:num_decode_transfer_queue_reqs", "decode waiting for KV", registry=r)
        self.prompt_tokens = Counter("pd:prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pd:generation_tokens", "tokens generated", registry=r)
        Counter("pd:num_retracted_reqs", "requests retracted", registry=r)
        self.prefix_cache = [Counter(f"{ns}:prefix_cache_{kind}", f"prompt tokens {doc} the prefix cache", registry=r)
                             for ns in ("pd", "vllm") for kind, doc in (("queries", "looked up in"),
                                                                        ("hits", "found in"))] if prefix_cache else []
        self.request_success = Counter(
            "pd:request_success", "finished requests", ["finished_reason"], registry=r
        )
        h = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = h("pd:time_to_first_token_seconds", "arrival to first token")
        self.itl = h("pd:inter_token_latency_seconds", "between consecutive tokens")
        self.e2e = h("pd:e2e_request_latency_seconds", "arrival to finish")
        self.queue_time = h("pd:request_queue_time_seconds", "waiting for admission")
        self.prefill_time = h("pd:request_prefill_time_seconds", "prefill compute")
        self.transfer_time = h("pd:request_transfer_time_seconds", "KV handover")
        self.decode_time = h("pd:request_decode_time_seconds", "first decode step to finish")
        self.kv_bytes = Counter("pd:kv_transfer_bytes", "KV bytes moved", registry=r)
        self.kv_latency = h("pd:kv_transfer_latency_seconds", "per transfer, post to completion")
        self.kv_speed = Histogram(
            "pd:kv_transfer_speed_gb_s", "per transfer GB/s", buckets=SPEED_BUCKETS, registry=r
        )
        self.kv_descriptors = Histogram(
            "pd:kv_transfer_num_descriptors", "descriptors per transfer", buckets=DESC_BUCKETS, registry=r
        )
        Counter("pd:kv_transfer_failed", "failed transfers", ["reason"], registry=r)
        self._gen_mark = (time.monotonic(), 0.0)

    def observe_prefix_cache(self, queries: int, hits: int) -> None:
        """Count one prompt's lookup in the emulated prefix cache (under the pd: and vllm: names)."""
        for i, c in enumerate(self.prefix_cache):
            c.inc(hits if i % 2 else queries)

    def observe_transfer(self, nbytes: int, seconds: float, num_descriptors: int) -> None:
        """Record one emulated KV push of ``nbytes`` bytes that took ``seconds``."""
        self.kv_bytes.inc(nbytes)
        self.kv_latency.observe(seconds)
        if seconds > 0:
            self.kv_speed.observe(nbytes / seconds / 1e9)
        self.kv_descriptors.observe(num_descriptors)

    def render(self, generated_total: int) -> bytes:
        """The Prometheus text exposition; also refreshes ``pd:gen_throughput`` from the
        server's count of generated tokens, over windows of at least 1 s."""
        now = time.monotonic()
        total = float(generated_total)
        t0, n0 = self._gen_mark
        if now - t0 >= 1.0:
            self.gen_throughput.set((total - n0) / (now - t0))
            self._gen_mark = (now, total)
        return generate_latest(self.registry)
