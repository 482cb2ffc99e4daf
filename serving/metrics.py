"""Prometheus metrics of a worker: SGLang's names under the prefix ``pd:`` (docs/worker-api.md), and the
same values again under vLLM's ``vllm:`` names, every series labelled ``model_name`` as vLLM's are.

Gauges are refreshed from the engine after every step (in the engine thread);
per-request histograms are observed when a request finishes. Every worker has
its own `CollectorRegistry`, so several workers (and tests) in one process do
not collide.

The ``vllm:`` names are what llm-d's endpoint picker, KEDA autoscaling recipes
and vLLM's Grafana dashboards read (vLLM ``vllm/v1/metrics/loggers.py``). They
are not separate metrics: at scrape time each ``pd:`` family in `VLLM_NAMES` is
written a second time under its vLLM name, so the two can never disagree.

Summed over every pod of a PD cluster, as those dashboards sum, each request counts once: the worker that
finishes a request (decode or mixed) counts it in ``request_success`` and the per-request token histograms,
while a prefill worker counts its ``/prefill`` jobs in ``pd:prefill_requests`` (no vLLM twin). Prompt tokens
are counted where they are computed. The prefix-cache counters of a decode worker (its lookups of prompts a
prefill worker already looked up) keep their ``pd:`` names but have no ``vllm:`` twins (`HIDDEN_TWINS`).
"""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import RequestDelta
from pd_cluster.serving.counter_totals import CounterTotals
from pd_cluster.serving.kv_store_metrics import KVStoreMetrics
from pd_cluster.serving.spec_metrics import SPEC_VLLM_NAMES, SpecDecodeMetrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
disable_created_metrics()  # no *_created series: they double the scrape size and no dashboard uses them

ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

MODEL_LABEL = "model_name"
FINISHED_REASON = "finished_reason"  # vLLM's label of request_success (its dashboards group by it)
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks")

# pd: family -> the vLLM (v1) families that carry the same value. Counters are named without
# ``_total`` here, as prometheus_client names families; the samples end in ``_total``.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pd:num_running_reqs": ("vllm:num_requests_running",),
    "pd:num_queue_reqs": ("vllm:num_requests_waiting",),
    # vLLM >= 0.10 calls it kv_cache_usage_perc; older endpoint pickers read gpu_cache_usage_perc.
    "pd:token_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pd:prompt_tokens": ("vllm:prompt_tokens",),
    "pd:generation_tokens": ("vllm:generation_tokens",),
    "pd:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pd:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    # vLLM counts its CPU-offload (connector) tier under external_*; ours is the host tier.
    "pd:external_prefix_cache_queries": ("vllm:external_prefix_cache_queries",),
    "pd:external_prefix_cache_hits": ("vllm:external_prefix_cache_hits",),
    "pd:num_retracted_reqs": ("vllm:num_preemptions",),
    "pd:request_success": ("vllm:request_success",),
    "pd:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM >= 0.11 calls it inter_token_latency_seconds; older dashboards read time_per_output_token_seconds.
    "pd:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "pd:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pd:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "pd:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "pd:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "pd:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "pd:request_generation_tokens": ("vllm:request_generation_tokens",),
    "pd:request_max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",),
    "pd:cache_config_info": ("vllm:cache_config_info",),
    # the KV store's traffic (`pd_cluster.serving.kv_store_metrics`), vLLM's offload counters
    "pd:kv_offload_total_bytes": ("vllm:kv_offload_total_bytes",),
    "pd:kv_offload_total_time": ("vllm:kv_offload_total_time",),
    **SPEC_VLLM_NAMES,  # speculative decoding's spec_decode_* counters
}

# The vLLM twins a role does not export, so that each figure is counted once per cluster (module docstring).
HIDDEN_TWINS: dict[str, frozenset[str]] = {
    "decode": frozenset({"pd:prefix_cache_queries", "pd:prefix_cache_hits", "pd:external_prefix_cache_queries",
                         "pd:external_prefix_cache_hits"}),
}

# vLLM's request-size histograms use 1-2-5 buckets (``build_1_2_5_buckets``) up to the context length; ours go to
# 10M tokens, the longest context a flag may ask.
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(8) for m in (1, 2, 5) if m * 10 ** e <= 10_000_000)

# Attributes of `engine.stats` read for the prefix-cache counters (totals since start, in prompt
# tokens: looked up in the prefix cache, and found there). Absent: the counters stay at 0.
PREFIX_CACHE_STATS = ("prefix_cache_queries", "prefix_cache_hits")
HOST_TIER_STATS = ("external_prefix_cache_queries", "external_prefix_cache_hits")


class WorkerMetrics:
    """The ``pd:*`` metrics of one worker and their ``vllm:*`` twins (the ``pd:kv_transfer_*`` ones and
    the inflight/transfer queue gauges come from `transfer.TransferMetrics` on the same registry, and
    carry no ``model_name`` label).

    Args:
        registry: where to expose (one per worker).
        role: ``prefill``, ``decode`` or ``mixed`` (a constant label on nothing; exposed in `/server_info`); a
            decode worker exports no ``vllm:`` twins of its prefix-cache counters (`HIDDEN_TWINS`).
        model_name: the served model name, the value of every series' ``model_name`` label. None: taken
            from the engine (``engine.model_name``) at the first `on_step`; until then the label is empty,
            which Prometheus treats as absent.
    """

    def __init__(self, registry: CollectorRegistry, role: str, model_name: str | None = None) -> None:
        self.role = role
        self.model_name = model_name
        own = CollectorRegistry()  # the pd: families; exposed on `registry` through `_Exposition`
        g = lambda name, doc: Gauge(f"pd:{name}", doc, registry=own)  # noqa: E731
        self.num_running_reqs = g("num_running_reqs", "Requests in the running batch.")
        self.num_queue_reqs = g("num_queue_reqs", "Requests waiting for admission.")
        self.token_usage = g("token_usage", "Used KV pages over all pages (0..1).")
        self.max_total_num_tokens = g("max_total_num_tokens", "KV pool capacity in tokens.")
        self.gen_throughput = g("gen_throughput", "Generated tokens/s over the last log interval.")
        self.num_prefill_bootstrap_queue_reqs = g("num_prefill_bootstrap_queue_reqs",
                                                  "Prefill: jobs waiting for their decode peer's metadata.")
        self.num_decode_prealloc_queue_reqs = g("num_decode_prealloc_queue_reqs", "Decode: requests waiting for pages.")
        c = lambda name, doc, labels=(): Counter(f"pd:{name}", doc, labels, registry=own)  # noqa: E731
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.num_retracted_reqs = c("num_retracted_reqs", "Requests retracted because the pool was full.")
        self.request_success = c("request_success", "Finished requests (on the worker that finishes them: decode or "
                                 "mixed).", (FINISHED_REASON,))
        self.prefill_requests = c("prefill_requests", "Prefill: /prefill jobs prefilled for a decode worker (the "
                                  "decode worker counts the request in request_success).")
        self.prefix_cache_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(0 while the engine does not count them).")
        self.prefix_cache_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(0 while the engine does not count them).")
        # The host tier (--enable-hierarchical-cache), SGLang's HiCache names; 0 while it is off.
        self.external_prefix_cache_queries = c("external_prefix_cache_queries", "Prompt tokens looked up while "
                                               "the host tier or the KV store is on.")
        self.external_prefix_cache_hits = c("external_prefix_cache_hits", "Prompt tokens loaded back from the "
                                            "host tier or read from the KV store at admission (external hits).")
        self.load_back_tokens = c("load_back_tokens", "Tokens of KV copied host tier -> device pool.")
        self.hicache_backup_tokens = c("hicache_backup_tokens", "Tokens of KV spilled device pool -> host tier.")
        self.evicted_tokens = c("evicted_tokens", "Tokens of cached KV evicted from the device pool.")
        self.hicache_host_used_tokens = g("hicache_host_used_tokens", "Tokens held by the host tier.")
        self.hicache_host_total_tokens = g("hicache_host_total_tokens", "Host tier capacity in tokens (0: off).")
        h = lambda name, doc, buckets=LATENCY_BUCKETS: Histogram(  # noqa: E731
            f"pd:{name}", doc, buckets=buckets, registry=own)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token, at this worker.")
        self.itl = h("inter_token_latency_seconds", "Between consecutive tokens.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = h("request_queue_time_seconds", "Per request: waiting for admission (pages).")
        self.prefill_time = h("request_prefill_time_seconds", "Per request: prefill compute, first to last chunk.")
        self.transfer_time = h("request_transfer_time_seconds", "Per request: KV handover: waiting for the KV minus prefill queueing and compute.")
        self.decode_time = h("request_decode_time_seconds", "Per request: first decode step to finish.")
        self.request_prompt_tokens = h("request_prompt_tokens", "Per finished request: prompt tokens.",
                                       TOKEN_BUCKETS)
        self.request_generation_tokens = h("request_generation_tokens", "Per finished request: generated tokens.",
                                           TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = h("request_max_num_generation_tokens", "Per finished request: "
                                                   "its max_tokens (the most it could generate).", TOKEN_BUCKETS)
        self.cache_config_info = Gauge("pd:cache_config_info", "The KV cache's configuration, in labels (value 1).",
                                       CACHE_CONFIG_LABELS, registry=own)
        self._inc = CounterTotals().add
        self.kv_store = KVStoreMetrics(own)  # cached tokens by source; the cluster-wide KV store
        self.spec_decode = SpecDecodeMetrics(own)  # speculative decoding (zero while it is off)
        self.prefix_cache_counted: bool | None = None  # None until the first step tells
        self.dropped_tokens = 0  # sampled for requests that return none (echo with max_tokens 0): not generated
        self._cache_config_set = False
        registry.register(_Exposition(own, self))

    def on_step(self, engine: LLMEngine) -> None:
        """Refresh gauges and counters from the engine (engine thread)."""
        if self.model_name is None:
            self.model_name = str(engine.model_name)
        if not self._cache_config_set:
            self.cache_config_info.labels(**cache_config_labels(engine)).set(1)
            self._cache_config_set = True
        load = engine.load()
        self.num_running_reqs.set(load["num_running_reqs"])
        self.num_queue_reqs.set(load["num_queue_reqs"])
        self.token_usage.set(load["token_usage"])
        self.max_total_num_tokens.set(engine.pool.max_total_num_tokens)
        self.gen_throughput.set(engine.stats.gen_throughput)
        st = engine.stats
        self._inc(self.prompt_tokens, "prompt", st.prompt_tokens_total)
        self._inc(self.generation_tokens, "gen", st.generation_tokens_total - self.dropped_tokens)
        self._inc(self.num_retracted_reqs, "retracted", engine.scheduler.num_retracted_total)
        queries, hits = (getattr(st, name, None) for name in PREFIX_CACHE_STATS)
        self.prefix_cache_counted = queries is not None and hits is not None
        if self.prefix_cache_counted:
            self._inc(self.prefix_cache_queries, "pc_queries", int(queries))
            self._inc(self.prefix_cache_hits, "pc_hits", int(hits))
        self._on_host_tier(engine)
        self.kv_store.on_step(engine)
        self.spec_decode.on_step(engine)

    def _on_host_tier(self, engine: LLMEngine) -> None:
        st, cache, host = engine.stats, getattr(engine, "prefix_cache", None), getattr(engine, "host_tier", None)
        if cache is not None:
            self._inc(self.evicted_tokens, "evicted", cache.num_evicted_total * cache.page_size)
        queries, hits = (int(getattr(st, name, 0)) for name in HOST_TIER_STATS)  # the host tier's and the store's
        self._inc(self.external_prefix_cache_queries, "ext_queries", queries)
        self._inc(self.external_prefix_cache_hits, "ext_hits", hits)
        if host is None:
            return
        self._inc(self.load_back_tokens, "load_back", host.load_back_pages_total * host.page_size)  # host only
        self._inc(self.hicache_backup_tokens, "backup", host.backup_pages_total * host.page_size)
        self.hicache_host_used_tokens.set(host.num_used * host.page_size)
        self.hicache_host_total_tokens.set(host.max_total_num_tokens)

    def on_request_finished(self, finished_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                            max_tokens: int | None) -> None:
        """Count one request that finished on this worker (decode or mixed; asyncio thread)."""
        self.request_success.labels(**{FINISHED_REASON: finished_reason}).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        if max_tokens is not None:
            self.request_max_num_generation_tokens.observe(max_tokens)


def cache_config_labels(engine: LLMEngine) -> dict[str, str]:
    """vLLM's ``cache_config_info`` labels that have a meaning here (vLLM ``CacheConfig.metrics_info``): page size
    as ``block_size``, the KV dtype, the prefix cache, device pages as ``num_gpu_blocks`` and host-tier pages as
    ``num_cpu_blocks``."""
    cache = engine.config.cache
    host = getattr(engine, "host_tier", None)
    return {"block_size": str(engine.layout.page_size), "cache_dtype": str(engine.layout.kv_cache_dtype),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "num_gpu_blocks": str(engine.allocator.num_pages),
            "num_cpu_blocks": str(host.max_total_num_tokens // host.page_size) if host is not None else "0"}


class _Exposition(Collector):
    """Writes the worker's ``pd:`` families with the ``model_name`` label, then their ``vllm:`` twins."""

    def __init__(self, own: CollectorRegistry, metrics: WorkerMetrics) -> None:
        self.own = own
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        model = self.metrics.model_name or ""
        hidden = HIDDEN_TWINS.get(self.metrics.role, frozenset())
        for fam in self.own.collect():
            yield _relabel(fam, fam.name, model)
            if fam.name in hidden:
                continue
            for alias in VLLM_NAMES.get(fam.name, ()):
                yield _relabel(fam, alias, model)


def _relabel(fam: Metric, name: str, model: str) -> Metric:
    """A copy of `fam` named `name` (sample suffixes such as ``_total``/``_bucket`` kept), labelled ``model``."""
    out = Metric(name, fam.documentation, fam.type, fam.unit)
    out.samples = [s._replace(name=name + s.name[len(fam.name):], labels={MODEL_LABEL: model, **s.labels})
                   for s in fam.samples]
    return out


class RequestTiming:
    """One request's latency and size metrics at the worker (`WorkerMetrics`).

    Args:
        arrival: ``time.monotonic()`` when the request arrived.
        max_tokens: its output budget (tokens).
        dropped: ``max_tokens`` 0 with ``echo``: the one token the engine sampled is not the client's, so the
            request counts as generating 0 of 0 tokens.
    """

    def __init__(self, metrics: WorkerMetrics, arrival: float, max_tokens: int | None = None,
                 dropped: bool = False) -> None:
        self.m = metrics
        self.arrival = arrival
        self.max_tokens = 0 if dropped else max_tokens
        self.dropped = dropped
        self.last: float | None = None

    def on_delta(self, d: RequestDelta) -> None:
        if not d.new_token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            self.m.ttft.observe(now - self.arrival)
        else:
            gap = (now - self.last) / len(d.new_token_ids)
            for _ in d.new_token_ids:
                self.m.itl.observe(gap)
        self.last = now

    def on_finish(self, finish_reason: str | None, d: RequestDelta) -> None:
        self.m.e2e.observe(time.monotonic() - self.arrival)
        self.m.on_request_finished(finish_reason or "unknown", d.num_prompt_tokens,
                                   0 if self.dropped else d.num_output_tokens, self.max_tokens)
        t = d.times
        if t is None:
            return
        # Each worker reports the phases it ran: a decode worker its page wait, the handover and decoding; the
        # prefill worker reports the prefill queue and compute of the same request.
        if t.admitted is not None:
            self.m.queue_time.observe(max(t.admitted - t.arrival, 0.0))
        if t.kv_wait_s is None and t.first_scheduled is not None and t.prefill_done is not None:  # local prefill
            self.m.prefill_time.observe(max(t.prefill_done - t.first_scheduled, 0.0))
        if t.transfer_s is not None:
            self.m.transfer_time.observe(t.transfer_s)
        if t.prefill_done is not None and t.finished is not None:
            self.m.decode_time.observe(max(t.finished - t.prefill_done, 0.0))
