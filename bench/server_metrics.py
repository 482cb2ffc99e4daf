"""The server-side breakdown of a pd-cluster run, from the ``pd:`` metrics of ``docs/worker-api.md``.

Endpoints: the target itself (the router, or a single worker) plus the workers
given by ``--worker-metrics-url`` or listed by the router's ``GET /workers``
(a JSON list of objects with ``url`` and ``role``). Each is scraped just before
the timed phase and just after it; the deltas give, per role, the mean and p99
of the time requests spent queued, prefilling, transferring KV and decoding,
and the KV bytes moved and their speed. During the run a background thread
polls each worker's ``/get_load`` (cheap JSON) for the peak token usage.
It also reports the server-side prefix-cache hit rate, from vLLM's
``vllm:prefix_cache_{queries,hits}_total`` (pd-cluster exports them too, and
``pd:``-named twins), so a vLLM target gets it as well, and speculative decoding's
mean accepted length and acceptance rate, from vLLM's ``vllm:spec_decode_*``
counters (likewise). A target with neither
(any other OpenAI server) gets no breakdown.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from pd_cluster.bench import prom
from pd_cluster.bench.config import ServerMetricsConfig

PHASES = (
    ("queue", "pd:request_queue_time_seconds"),
    ("prefill", "pd:request_prefill_time_seconds"),
    ("transfer", "pd:request_transfer_time_seconds"),
    ("decode", "pd:request_decode_time_seconds"),
    ("ttft (worker)", "pd:time_to_first_token_seconds"),
    ("e2e (worker)", "pd:e2e_request_latency_seconds"),
)


@dataclass(frozen=True)
class Endpoint:
    """One scraped server; ``role`` is router, prefill, decode, mixed, or unknown."""

    url: str
    role: str


@dataclass
class Scraper:
    """Scrapes the endpoints before/after the run and polls load in between."""

    endpoints: list[Endpoint]
    cfg: ServerMetricsConfig
    notes: list[str] = field(default_factory=list)
    peak_usage: dict[str, float] = field(default_factory=dict)
    peak_queue: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def snapshot(self) -> dict[str, prom.Scrape]:
        out = {}
        with _client(self.cfg) as c:
            for ep in self.endpoints:
                try:
                    r = c.get(ep.url.rstrip("/") + "/metrics")
                    r.raise_for_status()
                    out[ep.url] = prom.parse(r.text)
                except (httpx.HTTPError, ValueError) as exc:
                    self.notes.append(f"scrape of {ep.url}/metrics failed: {type(exc).__name__}")
        for url, s in out.items():
            self._peak(url, prom.gauge(s, "pd:token_usage"), prom.gauge(s, "pd:num_queue_reqs"))
        return out

    def _peak(self, url: str, usage: float | None, queue: float | None) -> None:
        if usage is not None:
            self.peak_usage[url] = max(self.peak_usage.get(url, 0.0), usage)
        if queue is not None:
            self.peak_queue[url] = max(self.peak_queue.get(url, 0.0), queue)

    def start_polling(self) -> None:
        workers = [ep for ep in self.endpoints if ep.role != "router"]
        if workers and self.cfg.poll_interval_s > 0:
            self._thread = threading.Thread(target=self._poll, args=(workers,), daemon=True)
            self._thread.start()

    def stop_polling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.timeout_s + 1)

    def _poll(self, workers: list[Endpoint]) -> None:
        with _client(self.cfg) as c:
            while not self._stop.wait(self.cfg.poll_interval_s):
                for ep in workers:
                    try:
                        load = c.get(ep.url.rstrip("/") + "/get_load").json()
                        self._peak(ep.url, load.get("token_usage"), load.get("num_queue_reqs"))
                    except (httpx.HTTPError, ValueError, AttributeError):
                        continue

    def breakdown(self, before: dict[str, prom.Scrape], after: dict[str, prom.Scrape],
                  duration_s: float) -> dict[str, Any]:
        """Per-role phase times (ms), KV transfer volume and speed, peak token usage."""
        roles = {ep.url: ep.role for ep in self.endpoints}
        phases = []
        for label, name in PHASES:
            for role, h in _per_role(before, after, roles, name).items():
                if h.count > 0:
                    phases.append({"phase": label, "role": role, "count": int(h.count),
                                   "mean_ms": h.mean * 1e3, "p50_ms": h.quantile(0.5) * 1e3,
                                   "p99_ms": h.quantile(0.99) * 1e3})
        return {"endpoints": [{"url": ep.url, "role": ep.role} for ep in self.endpoints],
                "phases": phases, "kv_transfer": _kv(before, after, roles, duration_s),
                "peak_token_usage": dict(self.peak_usage), "peak_queue_reqs": dict(self.peak_queue),
                "counters": _counters(before, after, roles),
                "prefix_cache": prefix_cache(before, after, roles),
                "spec_decode": spec_decode(before, after, roles), "notes": list(self.notes)}


def _per_role(before: dict, after: dict, roles: dict[str, str], name: str) -> dict[str, prom.HistogramDelta]:
    out: dict[str, prom.HistogramDelta] = {}
    for url, a in after.items():
        h = prom.histogram_delta(before.get(url, {}), a, name)
        if h is not None:
            role = roles.get(url, "unknown")
            out[role] = out[role].merged(h) if role in out else h
    return out


def _kv(before: dict, after: dict, roles: dict[str, str], duration_s: float) -> list[dict[str, Any]]:
    rows = []
    lat = _per_role(before, after, roles, "pd:kv_transfer_latency_seconds")
    speed = _per_role(before, after, roles, "pd:kv_transfer_speed_gb_s")
    for role in sorted(set(lat) | set(speed)):
        nbytes = sum(prom.delta_sum(before.get(u, {}), after[u], "pd:kv_transfer_bytes_total")
                     for u in after if roles.get(u) == role)
        failed = {}
        for u in after:
            if roles.get(u) == role:
                for k, v in prom.delta_by_label(before.get(u, {}), after[u],
                                                "pd:kv_transfer_failed_total", "reason").items():
                    failed[k] = failed.get(k, 0.0) + v
        h, s = lat.get(role), speed.get(role)
        if (h is None or h.count == 0) and nbytes == 0:
            continue
        busy = h.sum if h is not None else 0.0
        rows.append({"role": role, "transfers": int(h.count) if h else 0, "bytes": nbytes,
                     "gb_per_s_while_transferring": nbytes / busy / 1e9 if busy > 0 else math.nan,
                     "gb_per_s_over_run": nbytes / duration_s / 1e9 if duration_s > 0 else math.nan,
                     "speed_mean_gb_s": s.mean if s else math.nan,
                     "speed_p99_gb_s": s.quantile(0.99) if s else math.nan,
                     "latency_mean_ms": h.mean * 1e3 if h else math.nan,
                     "latency_p99_ms": h.quantile(0.99) * 1e3 if h else math.nan,
                     "failed": {k: int(v) for k, v in failed.items() if v}})
    return rows


def _counters(before: dict, after: dict, roles: dict[str, str]) -> dict[str, dict[str, float]]:
    names = ("pd:prompt_tokens_total", "pd:generation_tokens_total", "pd:num_retracted_reqs_total",
             "pd:request_success_total")
    out: dict[str, dict[str, float]] = {}
    for url, a in after.items():
        role = roles.get(url, "unknown")
        for n in names:
            d = prom.delta_sum(before.get(url, {}), a, n)
            if d:
                out.setdefault(role, {})[n] = out.get(role, {}).get(n, 0.0) + d
    return out


PREFIX_CACHE_NAMES = (("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
                      ("pd:prefix_cache_queries_total", "pd:prefix_cache_hits_total"))


def prefix_cache(before: dict, after: dict, roles: dict[str, str]) -> list[dict[str, Any]]:
    """Per role (routers skipped): prompt tokens looked up in the server's prefix cache during the run,
    those found, and the hit rate (hits / queries, in tokens, as vLLM defines it). vLLM's counter
    names are read first, then pd-cluster's own; endpoints exporting neither are left out."""
    rows: dict[str, list[float]] = {}
    for url, a in after.items():
        role = roles.get(url, "unknown")
        if role == "router":
            continue
        for queries, hits in PREFIX_CACHE_NAMES:
            if any(n == queries for n, _ in a):
                q, h = (prom.delta_sum(before.get(url, {}), a, n) for n in (queries, hits))
                acc = rows.setdefault(role, [0.0, 0.0])
                acc[0] += q
                acc[1] += h
                break
    return [{"role": role, "queries": q, "hits": h, "hit_rate": h / q if q > 0 else math.nan}
            for role, (q, h) in sorted(rows.items())]


def prefix_cache_hit_rate(breakdown: dict[str, Any] | None) -> float | None:
    """The hit rate over every role that looked prompts up in its prefix cache; None when none did."""
    rows = (breakdown or {}).get("prefix_cache") or []
    q, h = sum(r["queries"] for r in rows), sum(r["hits"] for r in rows)
    return h / q if q > 0 else None


SPEC_DECODE_NAMES = tuple(tuple(f"{ns}:spec_decode_{n}_total" for n in ("num_drafts", "num_draft_tokens",
                                                                          "num_accepted_tokens"))
                          for ns in ("vllm", "pd"))


def spec_decode(before: dict, after: dict, roles: dict[str, str]) -> list[dict[str, Any]]:
    """Per role (routers skipped) that drafted during the run: verifications (``drafts``: one per drafted request
    and step), draft tokens, accepted draft tokens, the acceptance rate (accepted / draft tokens) and the mean
    accepted length, vLLM's "mean acceptance length": tokens one verification yields, 1 + accepted / drafts.
    vLLM's counter names are read first, then pd-cluster's own."""
    rows: dict[str, list[float]] = {}
    for url, a in after.items():
        role = roles.get(url, "unknown")
        if role == "router":
            continue
        for names in SPEC_DECODE_NAMES:
            if any(n == names[0] for n, _ in a):
                acc = rows.setdefault(role, [0.0, 0.0, 0.0])
                for i, n in enumerate(names):
                    acc[i] += prom.delta_sum(before.get(url, {}), a, n)
                break
    return [{"role": role, "drafts": d, "draft_tokens": t, "accepted_tokens": k, "acceptance_rate": k / t if t else
             math.nan, "mean_accepted_length": 1 + k / d} for role, (d, t, k) in sorted(rows.items()) if d > 0]


def mean_accepted_length(breakdown: dict[str, Any] | None) -> float | None:
    """Speculative decoding's mean accepted length over every role that drafted; None when none did."""
    rows = (breakdown or {}).get("spec_decode") or []
    d, k = sum(r["drafts"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    return 1 + k / d if d > 0 else None


def discover(base_url: str, cfg: ServerMetricsConfig) -> Scraper | None:
    """The endpoints to scrape, or None when nothing exposes ``pd:`` metrics."""
    base = base_url.rstrip("/")
    eps: list[Endpoint] = []
    notes: list[str] = []
    with _client(cfg) as c:
        target_role = _role(c, base)
        base_has_pd = _has_pd(c, base)
        if base_has_pd:
            eps.append(Endpoint(base, target_role))
        urls = [(u.rstrip("/"), None) for u in cfg.worker_metrics_urls]
        if not urls and target_role in ("router", "unknown"):
            urls = _router_workers(c, base, notes)
        for url, role in urls:
            if url != base and _has_pd(c, url):
                eps.append(Endpoint(url, role or _role(c, url)))
    if not any(ep.role != "router" for ep in eps) and not base_has_pd:
        return None
    return Scraper(eps, cfg, notes)


def _client(cfg: ServerMetricsConfig) -> httpx.Client:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.Client(timeout=cfg.timeout_s, trust_env=False, headers=headers)


def _role(c: httpx.Client, url: str) -> str:
    """A worker's role from ``/server_info``; ``router`` when it has ``/workers`` (even if locked)."""
    try:
        r = c.get(url + "/server_info")
        if r.status_code == 200 and isinstance(r.json(), dict) and r.json().get("role"):
            return str(r.json()["role"])
    except (httpx.HTTPError, ValueError):
        pass
    try:
        if c.get(url + "/workers").status_code in (200, 401, 403):
            return "router"
    except httpx.HTTPError:
        pass
    return "unknown"


def _has_pd(c: httpx.Client, url: str) -> bool:
    try:
        r = c.get(url + "/metrics")
        return r.status_code == 200 and ("pd:" in r.text or "pd_router_" in r.text
                                         or "vllm:prefix_cache_queries" in r.text)
    except httpx.HTTPError:
        return False


def _router_workers(c: httpx.Client, base: str, notes: list[str]) -> list[tuple[str, str | None]]:
    try:
        r = c.get(base + "/workers")
        if r.status_code in (401, 403):
            notes.append(f"{base}/workers refused ({r.status_code}): pass --admin-api-key, "
                         "or the workers with --worker-metrics-url")
            return []
        if r.status_code != 200:
            return []
        body = r.json()
    except (httpx.HTTPError, ValueError):
        return []
    items = body.get("workers", []) if isinstance(body, dict) else body
    out = [(str(w["url"]).rstrip("/"), w.get("role")) for w in items if isinstance(w, dict) and w.get("url")]
    notes.append(f"found {len(out)} workers through {base}/workers")
    return out
