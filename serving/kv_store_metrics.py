"""Metrics of the prefix cache's tiers by source, and of the cluster-wide KV store (``docs/kv-store.md``).

Names are SGLang's where it has them (``cached_tokens`` by ``cache_source``, ``prefetched_tokens``,
``backuped_tokens``, ``prefetch_pgs``, ``backup_pgs``) and vLLM's for bytes and time moved
(``kv_offload_total_bytes`` / ``kv_offload_total_time`` by ``transfer_type``, exported under ``vllm:`` too, see
`pd_cluster.serving.metrics.VLLM_NAMES`); the rest are pd-cluster's (``kv_store_*``). The store's hit and miss
counts are per page looked up in it; `external_prefix_cache_*` (vLLM's) count the host tier's and the store's
hits together, per prompt token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd_cluster.serving.counter_totals import CounterTotals

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PAGE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SOURCES = ("device", "host", "storage")


class KVStoreMetrics:
    """The families above, on the worker's own registry; `on_step` refreshes them from the engine (engine thread)."""

    def __init__(self, own: CollectorRegistry) -> None:
        c = lambda name, doc, labels=(): Counter(f"pd:{name}", doc, labels, registry=own)  # noqa: E731
        self.cached_tokens = c("cached_tokens", "Prompt tokens served from the prefix cache, by where they were: "
                               "device, host (tier 2) or storage (the cluster-wide KV store).", ("cache_source",))
        self.prefetched_tokens = c("prefetched_tokens", "Tokens of KV read from the KV store and checked.")
        self.backuped_tokens = c("backuped_tokens", "Tokens of KV the KV store holds after this worker's writes.")
        self.lookup_tokens = c("kv_store_lookup_tokens", "Tokens looked up in the KV store (past the local cache).")
        self.hit_tokens = c("kv_store_hit_tokens", "Of those, tokens found in the KV store and read.")
        self.corrupt_pages = c("kv_store_corrupt_pages", "Pages read from the KV store and refused (checksum, key, "
                               "tokens, format or size); recomputed, never used.")
        self.dropped_pages = c("kv_store_write_dropped_pages", "Pages not written to the KV store (it was "
                               "unavailable, full, or the write queue was).")
        self.timeouts = c("kv_store_prefetch_timeouts", "Requests that stopped waiting for their pages from the KV "
                          "store (--hicache-storage-prefetch-policy).")
        self.disconnects = c("kv_store_disconnects", "Times the KV store became unreachable.")
        self.offload_bytes = c("kv_offload_total_bytes", "Bytes moved to or from the KV store.", ("transfer_type",))
        self.offload_time = c("kv_offload_total_time", "Seconds spent moving bytes to or from the KV store.",
                              ("transfer_type",))
        self.available = Gauge("pd:kv_store_available", "1 while the KV store answers, 0 while it does not; absent "
                               "without one.", registry=own)
        h = lambda name, doc, buckets: Histogram(f"pd:{name}", doc, buckets=buckets, registry=own)  # noqa: E731
        self.read_latency = h("kv_store_read_latency_seconds", "Per request: looking up and reading its pages in "
                              "the KV store.", LATENCY_BUCKETS)
        self.write_latency = h("kv_store_write_latency_seconds", "Per batch of pages written to the KV store.",
                               LATENCY_BUCKETS)
        self.prefetch_pgs = h("prefetch_pgs", "Pages read from the KV store per request.", PAGE_BUCKETS)
        self.backup_pgs = h("backup_pgs", "Pages written to the KV store per batch.", PAGE_BUCKETS)
        self._inc = CounterTotals().add
        self._tier = None

    def on_step(self, engine) -> None:
        st = engine.stats
        storage = int(getattr(st, "storage_cache_hits", 0))
        host = int(getattr(st, "external_prefix_cache_hits", 0)) - storage
        device = int(getattr(st, "prefix_cache_hits", 0))
        for source, total in zip(SOURCES, (device, host, storage)):
            self._inc(self.cached_tokens.labels(cache_source=source), source, total)
        tier = getattr(engine, "l3", None)
        if tier is None:
            return
        s, ps = tier.stats, tier.page_size
        if self._tier is not tier:  # read at scrape time: the store may come back while no step runs
            self._tier = tier
            self.available.set_function(lambda: 1.0 if tier.available else 0.0)
        for counter, key, total in ((self.prefetched_tokens, "prefetched", s.hit_pages * ps),
                                    (self.backuped_tokens, "backuped", s.written_pages * ps),
                                    (self.lookup_tokens, "lookup", s.lookup_pages * ps),
                                    (self.hit_tokens, "hit", s.hit_pages * ps),
                                    (self.corrupt_pages, "corrupt", s.corrupt_pages),
                                    (self.dropped_pages, "dropped", s.write_dropped_pages),
                                    (self.timeouts, "timeouts", s.prefetch_timeouts),
                                    (self.disconnects, "disconnects", s.disconnects),
                                    (self.offload_bytes.labels(transfer_type="STORAGE_to_GPU"), "rb", s.read_bytes),
                                    (self.offload_bytes.labels(transfer_type="GPU_to_STORAGE"), "wb", s.write_bytes),
                                    (self.offload_time.labels(transfer_type="STORAGE_to_GPU"), "rt", s.read_seconds),
                                    (self.offload_time.labels(transfer_type="GPU_to_STORAGE"), "wt", s.write_seconds)):
            self._inc(counter, key, total)
        reads, writes = s.drain()
        for seconds, pages in reads:
            self.read_latency.observe(seconds)
            self.prefetch_pgs.observe(pages)
        for seconds, pages in writes:
            self.write_latency.observe(seconds)
            self.backup_pgs.observe(pages)
