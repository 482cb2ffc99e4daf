"""The worker registry: every upstream the router may use, with its live state.

Workers come from static flags, the admin API, or discovery (Kubernetes,
Ray); each carries the source that added it, so a discovery source only ever
removes what it added. The registry is the only place URLs of upstreams come
from: the router never proxies to a host named in a request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from yarl import URL

from pd_cluster.router.circuit import CircuitBreaker
from pd_cluster.router.config import CircuitBreakerConfig, Role
from pd_cluster.router.load import LoadReport


def normalize_url(url: str) -> str:
    """``http(s)://host:port`` with no trailing slash.

    Raises ``ValueError`` for another scheme, a missing host, credentials,
    a path, a query or a fragment.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} has no host")
    if parts.username or parts.password:
        raise ValueError(f"worker URL {url!r} must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} must have no path, query or fragment")
    try:
        parts.port
    except ValueError as exc:
        raise ValueError(f"worker URL {url!r} has a bad port") from exc
    return f"{parts.scheme}://{parts.netloc}"


def worker_id(url: str) -> str:
    """A worker's stable id in ``/workers``: ``w`` and the first 12 hex digits of BLAKE2b over its normalized URL.

    A worker is its URL, so the id is the same on every router replica, after a router restart, through health
    changes and through role switches (``POST /workers/{id}/role``); a worker re-added at the same URL gets it
    back. Raises ``ValueError`` on a bad URL (`normalize_url`).
    """
    return "w" + hashlib.blake2b(normalize_url(url).encode(), digest_size=6).hexdigest()


@dataclass(eq=False)
class Worker:
    """One worker and what the router knows of it.

    ``inflight``: this router's requests using it now (a prefill until the
    first token, a decode until the end); ``inflight_extra``: their sequences
    beyond one each (a many-prompt request's). ``sent_since_report``: requests
    routed to it since its last ``/get_load`` report. ``max_running``: its
    ``max_running_requests`` from ``/server_info`` (0: unknown). ``busy_until``:
    ``time.monotonic()`` until which it is left alone after refusing a request
    for capacity (``router.capacity``). ``slow_checks``: probes that answered late
    or not yet while it showed other signs of life (busy, not dead; ``router.health``).
    ``healthy``: ready for new work. ``dead``: its connection was refused or reset after it had been
    seen alive (a fact, not a timeout; its in-flight requests are failed and migrated); cleared by the
    next check it passes. ``probe_seen``: ``time.monotonic()`` of its last probe answer, however late;
    ``progress``: its step and transfer counters (``/health``, ``/get_load``), and ``progress_at`` when
    they last advanced. ``pool``: its data-path connections (``router.upstream``). ``id``: its stable id
    (`worker_id`). ``switching``: the role it is switching to (``router.role_switch``): it takes no new work of
    its current role meanwhile and is not probed. ``draining``: it takes no new work, before it leaves (a planner's
    scale-down, ``POST /workers/{id}/drain``).
    """

    url: str
    role: Role
    source: str
    breaker: CircuitBreaker
    healthy: bool = False
    checked: bool = False
    ok_streak: int = 0
    fail_streak: int = 0
    load: LoadReport | None = None
    inflight: int = 0
    inflight_extra: int = 0
    sent_since_report: int = 0
    served_model_name: str | None = None
    incarnation: str | None = None
    max_running: int = 0
    busy_until: float = 0.0
    slow_checks: int = 0
    probe_seen: float = float("-inf")
    dead: bool = False
    progress: int = -1
    progress_at: float = float("-inf")
    pool: Any = field(default=None, repr=False)
    added_at: float = field(default_factory=time.monotonic)
    switching: Role | None = None
    draining: bool = False
    id: str = ""
    _urls: dict[str, URL] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.id = self.id or worker_id(self.url)

    def url_for(self, path: str) -> URL:
        """The parsed URL of ``path`` on this worker (cached: parsing costs per request)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.url + path)
        return url

    def usable(self, now: float) -> bool:
        """Healthy, not switching role nor draining, and its circuit breaker is not open."""
        return self.healthy and self.switching is None and not self.draining and self.breaker.allows(now)

    def note_progress(self, body: object, now: float) -> None:
        """Read the progress counters of a ``/health`` or ``/get_load`` answer (``num_steps``,
        ``num_kv_transfer_events``); ``progress_at`` moves when their sum advanced."""
        if not isinstance(body, dict):
            return
        steps, events = body.get("num_steps"), body.get("num_kv_transfer_events", 0)
        if not isinstance(steps, int) or isinstance(steps, bool) or not isinstance(events, int):
            return
        value = steps + events
        if value != self.progress:
            if self.progress >= 0:
                self.progress_at = now
            self.progress = value

    def set_load(self, report: LoadReport) -> None:
        self.load = report
        self.sent_since_report = 0

    def describe(self, now: float) -> dict[str, Any]:
        """JSON view for ``GET /workers``."""
        load = self.load
        return {
            "id": self.id, "url": self.url, "role": self.role.value, "source": self.source,
            "switching_to": None if self.switching is None else self.switching.value, "draining": self.draining,
            "healthy": self.healthy, "dead": self.dead, "circuit_state": self.breaker.state(now).value,
            "busy": self.busy_until > now, "slow_checks": self.slow_checks,
            "inflight": self.inflight, "served_model_name": self.served_model_name,
            "progress": None if self.progress < 0 else self.progress,
            "progress_age_secs": None if self.progress_at == float("-inf") else round(now - self.progress_at, 3),
            "load": None if load is None else {
                "num_running_reqs": load.num_running_reqs, "num_queue_reqs": load.num_queue_reqs,
                "waiting": load.waiting, "token_usage": load.token_usage,
                "num_free_pages": load.num_free_pages,
                "max_running_requests": load.max_running_requests,
                "age_secs": round(now - load.received_at, 3)},
        }


Listener = Callable[[Worker], None]


class WorkerRegistry:
    """URL -> :class:`Worker`, with add/remove listeners (policies, probes, metrics)."""

    def __init__(self, circuit: CircuitBreakerConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._circuit = circuit
        self._clock = clock
        self._workers: dict[str, Worker] = {}
        self._by_role: dict[Role, list[Worker]] = {r: [] for r in Role}
        self._on_added: list[Listener] = []
        self._on_removed: list[Listener] = []
        self.version = 0  # bumped on every change of membership or of what a worker reported (`touch`)
        self.on_breaker_transition: Callable[[str, str], None] | None = None  # given to each new breaker

    def touch(self) -> None:
        """A worker's reported facts (served model name) changed."""
        self.version += 1

    def subscribe(self, on_added: Listener | None = None,
                  on_removed: Listener | None = None) -> None:
        if on_added:
            self._on_added.append(on_added)
        if on_removed:
            self._on_removed.append(on_removed)

    def add(self, url: str, role: Role, source: str, healthy: bool = False) -> Worker:
        """Register a worker (idempotent for the same role).

        ``healthy``: start usable (discovery that already saw it Ready);
        otherwise it waits for its first health check. Raises ``ValueError``
        on a bad URL or when the URL is registered with another role.
        """
        url = normalize_url(url)
        existing = self._workers.get(url)
        if existing is not None:
            if existing.role is not role:
                raise ValueError(f"{url} is registered as {existing.role.value}, not {role.value}")
            return existing
        worker = Worker(url=url, role=role, source=source,
                        breaker=CircuitBreaker(self._circuit, url, role.value, self.on_breaker_transition),
                        healthy=healthy, checked=healthy)
        self._workers[url] = worker
        self._by_role[role].append(worker)
        self.version += 1
        for fn in self._on_added:
            fn(worker)
        return worker

    def remove(self, url: str, source: str | None = None) -> Worker | None:
        """Unregister ``url``; with ``source``, only if that source added it."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None or (source is not None and worker.source != source):
            return None
        del self._workers[url]
        self._by_role[worker.role].remove(worker)
        self.version += 1
        for fn in self._on_removed:
            fn(worker)
        return worker

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def by_id(self, worker_id_: str) -> Worker | None:
        """The worker whose stable `Worker.id` is `worker_id_`, else None."""
        return next((w for w in self._workers.values() if w.id == worker_id_), None)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def of_role(self, role: Role) -> list[Worker]:
        return list(self._by_role[role])

    def from_source(self, source: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.source == source]

    def usable(self, role: Role, exclude: frozenset[str] | set[str] = frozenset()) -> list[Worker]:
        """Workers of ``role`` that may take a request now, minus ``exclude`` URLs."""
        now = self._clock()
        return [w for w in self._by_role[role] if w.url not in exclude and w.usable(now)]

    def has_role(self, role: Role) -> bool:
        return bool(self._by_role[role])
