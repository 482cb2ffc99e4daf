"""Prometheus metrics of a worker, with SGLang's names under the prefix ``pd:`` (docs/worker-api.md).

Gauges are refreshed from the engine after every step (in the engine thread);
per-request histograms are observed when a request finishes. Every worker has
its own `CollectorRegistry`, so several workers (and tests) in one process do
not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pd_cluster.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
disable_created_metrics()  # no *_created series: they double the scrape size and no dashboard uses them

ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class WorkerMetrics:
    """The ``pd:*`` metrics of one worker (the ``pd:kv_transfer_*`` ones and the inflight/transfer
    queue gauges come from `transfer.TransferMetrics` on the same registry).

    Args:
        registry: where to register (one per worker).
        role: ``prefill``, ``decode`` or ``mixed`` (a constant label on nothing; exposed in `/server_info`).
    """

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.role = role
        g = lambda name, doc: Gauge(f"pd:{name}", doc, registry=registry)  # noqa: E731
        self.num_running_reqs = g("num_running_reqs", "Requests in the running batch.")
        self.num_queue_reqs = g("num_queue_reqs", "Requests waiting for admission.")
        self.token_usage = g("token_usage", "Used KV pages over all pages (0..1).")
        self.max_total_num_tokens = g("max_total_num_tokens", "KV pool capacity in tokens.")
        self.gen_throughput = g("gen_throughput", "Generated tokens/s over the last log interval.")
        self.num_prefill_bootstrap_queue_reqs = g("num_prefill_bootstrap_queue_reqs",
                                                  "Prefill: jobs waiting for their decode peer's metadata.")
        self.num_decode_prealloc_queue_reqs = g("num_decode_prealloc_queue_reqs", "Decode: requests waiting for pages.")
        c = lambda name, doc, labels=(): Counter(f"pd:{name}", doc, labels, registry=registry)  # noqa: E731
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.num_retracted_reqs = c("num_retracted_reqs", "Requests retracted because the pool was full.")
        self.request_success = c("request_success", "Finished requests.", ("finish_reason",))
        h = lambda name, doc, buckets=LATENCY_BUCKETS: Histogram(  # noqa: E731
            f"pd:{name}", doc, buckets=buckets, registry=registry)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token, at this worker.")
        self.itl = h("inter_token_latency_seconds", "Between consecutive tokens.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = h("request_queue_time_seconds", "Per request: waiting for admission (pages).")
        self.prefill_time = h("request_prefill_time_seconds", "Per request: prefill compute, first to last chunk.")
        self.transfer_time = h("request_transfer_time_seconds", "Per request: KV handover: waiting for the KV minus prefill queueing and compute.")
        self.decode_time = h("request_decode_time_seconds", "Per request: first decode step to finish.")
        self._seen = {"prompt": 0, "gen": 0, "retracted": 0}

    def on_step(self, engine: LLMEngine) -> None:
        """Refresh gauges and counters from the engine (engine thread)."""
        load = engine.load()
        self.num_running_reqs.set(load["num_running_reqs"])
        self.num_queue_reqs.set(load["num_queue_reqs"])
        self.token_usage.set(load["token_usage"])
        self.max_total_num_tokens.set(engine.pool.max_total_num_tokens)
        self.gen_throughput.set(engine.stats.gen_throughput)
        st = engine.stats
        self._inc(self.prompt_tokens, "prompt", st.prompt_tokens_total)
        self._inc(self.generation_tokens, "gen", st.generation_tokens_total)
        self._inc(self.num_retracted_reqs, "retracted", engine.scheduler.num_retracted_total)

    def _inc(self, counter: Counter, key: str, total: int) -> None:
        if total > self._seen[key]:
            counter.inc(total - self._seen[key])
            self._seen[key] = total
