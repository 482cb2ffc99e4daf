"""Filling the decision core's `Snapshot` from the endpoints a running cluster already exposes.

One scrape reads, over HTTP:

* the router's ``GET /workers`` (admin key): every worker's stable id, role, health, ``draining`` and
  ``switching_to``, and its in-flight requests (`WorkerView`); each role's count is its workers not draining and
  not switching (`WorkerView.counted`), and the healthy ones among them are scraped;
* the router's ``GET /metrics`` (the API key, which the router's ``--api-key-protects-all-paths`` asks of every
  path but its probes and ``/workers``): ``pd_router_time_to_first_token_seconds`` and
  ``pd_router_inter_token_latency_seconds`` (the TTFT and ITL p90 over the window since the last scrape), and
  ``pd_router_queue_depth`` (requests waiting in the router);
* each serving worker's ``GET /get_load`` (running and queued requests, KV usage, ``max_running_requests``, a
  prefill's ``num_prefill_inflight_queue_reqs`` and a decode's ``num_decode_transfer_queue_reqs``: the outstanding
  KV transfers, of which those whose prompt is still queued or computing on a prefill worker are prefill's
  backlog, `owed_transfers`) and ``GET /metrics`` (``vllm:request_queue_time_seconds`` and
  ``vllm:prompt_tokens_total``: the queue-time p90, the prompt throughput, and with the queue-time count the mean
  prompt length).

Percentiles are taken over the window between two scrapes from the difference of the cumulative histogram
buckets, interpolated inside a bucket as Prometheus' ``histogram_quantile`` does; a counter that went down (a
restarted process) starts its window from zero. The prompt backlog is an estimate: the requests queued or
computing on the prefill workers times the window's mean prompt length (the workers export no token count of
their queues). A source that does not answer is named in `Snapshot.missing`, which freezes the decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster.common.histogram import histogram_quantile
from pd_cluster.planner.decision import RoleCounts, Snapshot

TTFT = "pd_router_time_to_first_token_seconds"
ITL = "pd_router_inter_token_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
ROUTER_QUEUE = "pd_router_queue_depth"
PROMPT_TOKENS = "vllm:prompt_tokens"


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router lists it (``GET /workers``), with its ``/get_load`` when it was read."""

    id: str
    url: str
    role: str
    healthy: bool
    draining: bool = False
    switching_to: str | None = None
    inflight: int = 0
    load: dict[str, Any] | None = None

    @property
    def counted(self) -> bool:
        """Counted in its role's size: not draining, not switching. A worker that is briefly unhealthy (restarting,
        a failed probe) still counts: its launcher or its StatefulSet brings it back, and counting it out would make
        a role look under its minimum."""
        return not self.draining and self.switching_to is None

    @property
    def serving(self) -> bool:
        """Counted and healthy: its metrics are read, and a connector may take it."""
        return self.healthy and self.counted


@dataclass(frozen=True)
class ClusterView:
    """One scrape: the snapshot for the decision core and the workers a connector picks from."""

    snapshot: Snapshot
    workers: tuple[WorkerView, ...]

    def serving(self, role: str) -> list[WorkerView]:
        return [w for w in self.workers if w.role == role and w.serving]


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """``{upper bound: cumulative count}`` of histogram `name` in Prometheus text, summed over its label sets."""
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


def counter_total(text: str, name: str) -> float | None:
    """The sum over label sets of counter `name` (its ``_total`` samples), None when absent."""
    total = None
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name == name + "_total":
                    total = (total or 0.0) + s.value
    return total


def gauge_total(text: str, name: str) -> float | None:
    """The sum over label sets of gauge `name`, None when absent."""
    total = None
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name == name:
                    total = (total or 0.0) + s.value
    return total


def window(now: dict[float, float], before: dict[float, float] | None) -> dict[float, float]:
    """The buckets' counts since `before` (all of `now` when there is none, or when a count went down)."""
    if not before or any(now.get(le, 0.0) < c for le, c in before.items()):
        return dict(now)
    return {le: c - before.get(le, 0.0) for le, c in now.items()}


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The `q` quantile of cumulative `buckets` (``{le: count}``, ``+Inf`` included), as Prometheus'
    ``histogram_quantile`` (`pd_cluster.common.histogram`); None with no observation."""
    return histogram_quantile(q, sorted(buckets.items()))


def owed_transfers(prefill: list[WorkerView], decode: list[WorkerView], computing: int) -> int:
    """KV transfers whose prompt is computed but whose pages have not reached their decode worker yet.

    A decode worker reserves pages and hands its ticket to the prefill worker before the prompt is computed
    (``docs/architecture.md``, hop 2), so its ``num_decode_transfer_queue_reqs`` (and the prefill side's
    ``num_prefill_inflight_queue_reqs``) also count requests still waiting or computing on the prefill workers
    (`computing`: their queued and running requests): that is prefill's backlog, not decode's. What is left once
    those are taken out waits on the push or on decode. Each transfer is counted on both sides; the larger side
    is taken, as the two are read at slightly different times."""
    on_prefill = sum(w.load.get("num_prefill_inflight_queue_reqs", 0) for w in prefill)
    on_decode = sum(w.load.get("num_decode_transfer_queue_reqs", 0) for w in decode)
    return max(0, max(on_prefill, on_decode) - computing)


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


class MetricsSource:
    """Scrapes a cluster through its router (`ClusterView` per `fetch`); keeps the previous scrape for windows.

    Args:
        router_url: the router's base URL.
        admin_api_key: the router's admin key (``GET /workers`` needs it when set).
        api_key: the router's API key, sent to its ``GET /metrics`` (needed under ``--api-key-protects-all-paths``).
        timeout: seconds for each HTTP call.
        clock: monotonic seconds (the snapshot's ``at``).
        q: the percentile the decision core reads (0.9: its p90).
    """

    def __init__(self, router_url: str, admin_api_key: str | None = None, timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, q: float = 0.9, api_key: str | None = None) -> None:
        self.router_url = router_url.rstrip("/")
        self.headers = _bearer(admin_api_key)  # GET /workers
        self.metrics_headers = _bearer(api_key)  # the router's GET /metrics
        self.timeout, self.clock, self.q = timeout, clock, q
        self._prev: dict[str, Any] = {}  # source key -> its last buckets or counter values
        self._prev_at: float | None = None

    def fetch(self) -> ClusterView:
        """Scrape once. Never raises for an unreachable source: it is named in ``snapshot.missing``."""
        at = self.clock()
        missing: list[str] = []
        with httpx.Client(timeout=self.timeout) as client:
            workers = self._workers(client, missing)
            router_text = self._text(client, self.router_url + "/metrics", "router /metrics", missing,
                                     self.metrics_headers)
            loaded, texts = [], {}
            for w in workers:
                if not w.serving or w.role not in ("prefill", "decode"):
                    loaded.append(w)
                    continue
                load = self._json(client, w.url + "/get_load", f"{w.role} {w.id} /get_load", missing)
                texts[w.id] = self._text(client, w.url + "/metrics", f"{w.role} {w.id} /metrics", missing)
                loaded.append(replace(w, load=load if isinstance(load, dict) else None))
        counts = RoleCounts(sum(w.counted for w in loaded if w.role == "prefill"),
                            sum(w.counted for w in loaded if w.role == "decode"))
        snap = Snapshot(at=at, current=counts, missing=tuple(missing))
        if not missing:
            snap = self._signals(snap, router_text or "", loaded, texts, at)
        self._prev_at = at
        return ClusterView(snap, tuple(loaded))

    def refusals(self) -> dict[str, int]:
        """The router's paths the planner reads that refuse its keys now: ``{"/workers": 401, ...}`` (401 or 403;
        empty when both answer, or when the router does not answer at all: that is an outage, not a refusal).
        ``pd-planner`` stops at start-up on one (a key that is refused would freeze every decision for good)."""
        out: dict[str, int] = {}
        with httpx.Client(timeout=self.timeout) as client:
            for path, headers in (("/workers", self.headers), ("/metrics", self.metrics_headers)):
                try:
                    status = client.get(self.router_url + path, headers=headers).status_code
                except httpx.HTTPError:
                    continue
                if status in (401, 403):
                    out[path] = status
        return out

    # ---- signals ------------------------------------------------------------------------------------------------
    def _windowed(self, key: str, buckets: dict[float, float]) -> dict[float, float]:
        before = self._prev.get(key)
        self._prev[key] = buckets
        return window(buckets, before)

    def _delta(self, key: str, value: float | None) -> float | None:
        before = self._prev.get(key)
        self._prev[key] = value
        if value is None:
            return None
        return value if before is None or value < before else value - before

    def _signals(self, snap: Snapshot, router_text: str, workers: list[WorkerView], texts: dict[str, str],
                 at: float) -> Snapshot:
        ttft = quantile(self.q, self._windowed("router ttft", histogram_buckets(router_text, TTFT)))
        itl = quantile(self.q, self._windowed("router itl", histogram_buckets(router_text, ITL)))
        prefill = [w for w in workers if w.role == "prefill" and w.serving and w.load]
        decode = [w for w in workers if w.role == "decode" and w.serving and w.load]
        queue: dict[float, float] = {}
        prompt_tokens = 0.0
        for w in prefill:
            text = texts.get(w.id) or ""
            for le, c in self._windowed(f"{w.id} queue", histogram_buckets(text, QUEUE_TIME)).items():
                queue[le] = queue.get(le, 0.0) + c
            prompt_tokens += self._delta(f"{w.id} prompt", counter_total(text, PROMPT_TOKENS)) or 0.0
        finished = queue.get(float("inf"), 0.0)  # requests admitted in the window (each has a queue time)
        elapsed = None if self._prev_at is None else at - self._prev_at
        per_worker_tps = (prompt_tokens / elapsed / len(prefill)) if elapsed and prefill else None
        waiting = sum(w.load.get("num_queue_reqs", 0) + w.load.get("num_running_reqs", 0) for w in prefill)
        backlog = round(waiting * prompt_tokens / finished) if finished else None
        cap = sum(w.load.get("max_running_requests", 0) for w in decode)
        queued = gauge_total(router_text, ROUTER_QUEUE)
        transfers = owed_transfers(prefill, decode, waiting)
        return replace(
            snap, ttft_p90_ms=_ms(ttft), itl_p90_ms=_ms(itl), queue_time_p90_ms=_ms(quantile(self.q, queue)),
            prefill_backlog_tokens=backlog, prefill_tokens_per_s=per_worker_tps or None,
            decode_kv_usage=(sum(w.load.get("token_usage", 0.0) for w in decode) / len(decode)) if decode else None,
            decode_running=sum(w.load.get("num_running_reqs", 0) for w in decode) if decode else None,
            decode_capacity=cap or None, outstanding_transfers=transfers,
            prefill_waiting=waiting if prefill else None, router_queued=None if queued is None else round(queued))

    # ---- HTTP ---------------------------------------------------------------------------------------------------
    def _workers(self, client: httpx.Client, missing: list[str]) -> list[WorkerView]:
        body = self._json(client, self.router_url + "/workers", "router /workers", missing, self.headers)
        if not isinstance(body, dict):
            return []
        return [WorkerView(id=w["id"], url=w["url"], role=w["role"], healthy=bool(w.get("healthy")),
                           draining=bool(w.get("draining")), switching_to=w.get("switching_to"),
                           inflight=int(w.get("inflight") or 0)) for w in body.get("workers", [])]

    @staticmethod
    def _json(client: httpx.Client, url: str, name: str, missing: list[str], headers=None) -> Any:
        try:
            r = client.get(url, headers=headers)
            r.raise_for_status()
            return r.json()
        except httpx.HTTPStatusError as e:
            missing.append(f"{name} ({e.response.status_code})")
        except (httpx.HTTPError, ValueError):
            missing.append(name)
        return None

    @staticmethod
    def _text(client: httpx.Client, url: str, name: str, missing: list[str], headers=None) -> str | None:
        try:
            r = client.get(url, headers=headers)
            r.raise_for_status()
            return r.text
        except httpx.HTTPStatusError as e:
            missing.append(f"{name} ({e.response.status_code})")
        except httpx.HTTPError:
            missing.append(name)
        return None
