"""Prometheus metrics of the router, prefix ``pd_router_`` (listed in ``docs/router.md``).

The metrics touched by every request (the request counter, the per-worker choice counter and the TTFT,
ITL and end-to-end histograms) are plain integers and lists updated in place and turned into Prometheus
families at scrape time (`HotCollector`): a ``prometheus_client`` counter or histogram takes a lock and
walks its buckets on every update, a cost paid per token for the ITL. Per-worker state (health, circuit,
load, in-flight), the queue depth and the cache-aware decisions are read from live objects at scrape time
by `StateCollector`, so they cost nothing per request. Rare events (retries, migrations, failures,
rejections) are ordinary ``prometheus_client`` counters. Each router owns its own ``CollectorRegistry`` (no
process-global state). As on the workers (vLLM's convention), every series carries a ``model_name`` label (the
served model name; several names joined by ``,``; empty before a worker reported one), and no ``_created``
series are exported.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pd_cluster.router.circuit import STATE_CODES
from pd_cluster.router.config import Role
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.text_map import TextMap
from pd_cluster.router.policies import CacheAware, Policy, effective_load
from pd_cluster.router.workers import WorkerRegistry

disable_created_metrics()  # no *_created series: no dashboard reads them (the workers' metrics do the same)
MODEL_LABEL = "model_name"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0,
               5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

SWITCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class FastHistogram:
    """A histogram of seconds: one list slot per bucket (``le`` upper bounds, +Inf last) and a sum.

    Same exposition as ``prometheus_client.Histogram`` (cumulative ``_bucket``, ``_count``, ``_sum``).
    """

    __slots__ = ("name", "doc", "bounds", "counts", "total")

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=self.total)


class HotCollector(Collector):
    """Scrape-time families of the per-request metrics of `RouterMetrics`."""

    def __init__(self, metrics: "RouterMetrics") -> None:
        self._m = metrics

    def collect(self) -> Iterator:
        m = self._m
        requests = CounterMetricFamily("pd_router_requests", "Requests answered, by endpoint and status.",
                                       labels=["endpoint", "status"])
        for (endpoint, status), count in sorted(m.request_counts.items()):
            requests.add_metric([endpoint, str(status)], count)
        chosen = CounterMetricFamily("pd_router_worker_requests", "Requests routed to each worker, by role.",
                                     labels=["role", "worker"])
        for (role, worker), count in sorted(m.worker_counts.items()):
            chosen.add_metric([role, worker], count)
        yield requests
        yield chosen
        for histogram in (m.ttft, m.itl, m.e2e):
            yield histogram.family()


class RouterMetrics:
    """Metric objects of one router; ``render()`` gives the exposition text."""

    def __init__(self, model_name: Callable[[], str] = lambda: "") -> None:
        self.registry = CollectorRegistry()
        self._exposed = CollectorRegistry()  # `registry`'s families with the model_name label
        self._exposed.register(_ModelLabelled(self.registry, model_name))
        r = self.registry
        self.request_counts: dict[tuple[str, int], int] = {}
        self.worker_counts: dict[tuple[str, str], int] = {}
        self.ttft = FastHistogram("pd_router_time_to_first_token_seconds",
                                  "Arrival at the router to the first streamed chunk relayed.", TTFT_BUCKETS)
        self.itl = FastHistogram("pd_router_inter_token_latency_seconds",
                                 "Time between consecutive streamed events relayed.", ITL_BUCKETS)
        self.e2e = FastHistogram("pd_router_e2e_request_latency_seconds",
                                 "Arrival at the router to the end of the response.", E2E_BUCKETS)
        r.register(HotCollector(self))
        self.retries = Counter("pd_router_retries",
                               "Retries on a fresh pair, by reason and the worker's error code (if any).",
                               ["reason", "code"], registry=r)
        self.migrations = Counter(
            "pd_router_migrations", "Streams moved to another pair after they started, by reason.",
            ["reason"], registry=r)
        self.upstream_failures = Counter(
            "pd_router_upstream_failures", "Failed attempts, by blamed role and reason.",
            ["role", "reason"], registry=r)
        self.rejected = Counter("pd_router_rejected_requests",
                                "Requests refused by the router itself, by reason.",
                                ["reason"], registry=r)
        self.cb_transitions = Counter("pd_router_cb_state_transitions",
                                      "Circuit breaker transitions, by role and the state entered.",
                                      ["role", "to_state"], registry=r)
        self.worker_deaths = Counter("pd_router_worker_deaths",
                                     "Workers found dead (connection refused or reset after they were seen alive).",
                                     ["role"], registry=r)
        self.inflight_failed = Counter("pd_router_inflight_failed_by_health",
                                       "Attempts in flight failed because their worker was found dead.",
                                       ["role"], registry=r)

        self.role_switches = Counter("pd_router_role_switches",
                                     "Worker role switches (POST /workers/{id}/role), by roles and outcome.",
                                     ["from_role", "to_role", "outcome"], registry=r)
        self.role_switch_seconds = Histogram("pd_router_role_switch_duration_seconds",
                                             "A successful role switch, from the request to the worker serving "
                                             "its new role.", ["from_role", "to_role"], buckets=SWITCH_BUCKETS,
                                             registry=r)

    def count_request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        counts = self.request_counts
        counts[key] = counts.get(key, 0) + 1

    def count_choice(self, role: str, worker: str) -> None:
        key = (role, worker)
        counts = self.worker_counts
        counts[key] = counts.get(key, 0) + 1

    def forget_worker(self, role: str, worker: str) -> None:
        """Drop the per-worker series of a worker that left the registry."""
        self.worker_counts.pop((role, worker), None)

    def attach_state(self, collector: "StateCollector") -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self._exposed)


class _ModelLabelled(Collector):
    """The families of `registry`, each sample labelled ``model_name`` (first)."""

    def __init__(self, registry: CollectorRegistry, model_name: Callable[[], str]) -> None:
        self.registry, self.model_name = registry, model_name

    def collect(self) -> Iterator[Metric]:
        model = self.model_name()
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={MODEL_LABEL: model, **s.labels}) for s in fam.samples]
            yield out


class StateCollector(Collector):
    """Scrape-time gauges over the registry, the limiter and the policies."""

    def __init__(self, workers: WorkerRegistry, queue_depth: Callable[[], int],
                 running: Callable[[], int], policies: dict[str, Policy],
                 clock: Callable[[], float] = time.monotonic, kv_index: KvIndex | None = None,
                 tokenizer_loaded: Callable[[], bool] = lambda: False,
                 tokenizer_counts: Callable[[], dict[str, int]] | None = None, text_map: TextMap | None = None) -> None:
        self._workers = workers
        self._kv_index = kv_index
        self._tokenizer_loaded = tokenizer_loaded
        self._tokenizer_counts = tokenizer_counts
        self._text_map = text_map
        self._queue_depth = queue_depth
        self._running = running
        self._policies = policies
        self._clock = clock

    def collect(self) -> Iterator:
        yield GaugeMetricFamily("pd_router_queue_depth", "Requests waiting in the router (for a slot or for "
                                "a worker with room).",
                                value=self._queue_depth())
        yield GaugeMetricFamily("pd_router_running_requests", "Requests holding a router slot.",
                                value=self._running())
        yield from self._worker_families()
        yield from self._cache_families()
        if self._kv_index is not None:
            yield from self._kv_families(self._kv_index)

    def _worker_families(self) -> Iterator:
        now = self._clock()
        labels = ["role", "worker"]
        healthy = GaugeMetricFamily("pd_router_worker_healthy", "1 if healthy.", labels=labels)
        circuit = GaugeMetricFamily("pd_router_circuit_state",
                                    "Circuit breaker: 0 closed, 1 open, 2 half-open.", labels=labels)
        inflight = GaugeMetricFamily("pd_router_worker_inflight_requests",
                                     "This router's requests in flight to the worker.", labels=labels)
        load = GaugeMetricFamily("pd_router_worker_load",
                                 "Estimated requests at the worker (reported + sent since).",
                                 labels=labels)
        usage = GaugeMetricFamily("pd_router_worker_token_usage",
                                  "Last reported KV usage, 0..1.", labels=labels)
        busy = GaugeMetricFamily("pd_router_worker_busy", "1 while the worker is left alone after refusing a "
                                 "request for capacity.", labels=labels)
        slow = CounterMetricFamily("pd_router_worker_slow_probes", "Probes that timed out while the worker kept "
                                   "sending (busy, not counted as failures).", labels=labels)
        for w in self._workers.all():
            lv = [w.role.value, w.url]
            healthy.add_metric(lv, 1.0 if w.healthy else 0.0)
            circuit.add_metric(lv, STATE_CODES[w.breaker.state(now)])
            inflight.add_metric(lv, w.inflight)
            load.add_metric(lv, effective_load(w))
            if w.load is not None:
                usage.add_metric(lv, w.load.token_usage)
            busy.add_metric(lv, 1.0 if w.busy_until > now else 0.0)
            slow.add_metric(lv, w.slow_checks)
        yield from (healthy, circuit, inflight, load, usage, busy, slow)

    def _cache_families(self) -> Iterator:
        decisions = CounterMetricFamily(
            "pd_router_cache_aware_decisions", "cache_aware choices: hit, miss or balance.",
            labels=["role", "outcome"])
        ratio = GaugeMetricFamily("pd_router_cache_aware_hit_ratio",
                                  "cache_aware hits / decisions since start.", labels=["role"])
        entries = GaugeMetricFamily("pd_router_cache_aware_tree_entries",
                                    "Entries in the approximate prefix tree.", labels=["role"])
        routed = CounterMetricFamily(
            "pd_router_cache_aware_routed", "cache_aware decisions by source: kv_events (the workers' "
            "reported cache state) or approx_tree (the fallback).", labels=["role", "source"])
        for role, policy in self._policies.items():
            if isinstance(policy, CacheAware) and self._workers.has_role(Role(role)):
                decisions.add_metric([role, "hit"], policy.hits)
                decisions.add_metric([role, "miss"], policy.misses)
                decisions.add_metric([role, "balance"], policy.balanced)
                ratio.add_metric([role], policy.hit_ratio)
                entries.add_metric([role], len(policy.tree))
                routed.add_metric([role, "kv_events"], policy.by_events)
                routed.add_metric([role, "approx_tree"], policy.by_tree)
        yield from (decisions, ratio, entries, routed)

    def _kv_families(self, index: KvIndex) -> Iterator:
        received = CounterMetricFamily("pd_router_kv_events_received",
                                       "KV events applied from the workers' /kv_events.")
        received.add_metric([], index.events_received)
        resyncs = CounterMetricFamily("pd_router_kv_index_resyncs",
                                      "Worker indexes dropped for a resync, by reason.", labels=["reason"])
        for reason, count in sorted(index.resyncs.items()):
            resyncs.add_metric([reason], count)
        synced = GaugeMetricFamily("pd_router_kv_index_synced_workers", "Workers whose KV index is synced.")
        synced.add_metric([], index.num_synced())
        tok = GaugeMetricFamily("pd_router_tokenizer_loaded", "1 once the router's tokenizer has loaded.")
        tok.add_metric([], 1.0 if self._tokenizer_loaded() else 0.0)
        if self._tokenizer_counts is not None:
            prompts = CounterMetricFamily("pd_router_tokenizer_prompts", "Prompts given token ids, by source: cache "
                                          "(seen before), reused (a chat's earlier turn), encoded (whole).",
                                          labels=["source"])
            for source, count in sorted(self._tokenizer_counts().items()):
                prompts.add_metric([source], count)
            yield prompts
        yield from (received, resyncs, synced, tok)
        if self._text_map is not None:
            entries = GaugeMetricFamily("pd_router_kv_text_map_entries",
                                        "Entries of the workers' text-to-page maps held.")
            entries.add_metric([], len(self._text_map))
            got = CounterMetricFamily("pd_router_kv_text_map_received", "Text-to-page map entries received from "
                                      "the workers' /kv_text_map.")
            got.add_metric([], self._text_map.entries_received)
            yield from (entries, got)
