"""The policy interface: pure selection over candidate workers, no I/O.

A policy sees each candidate's URL, its last ``/get_load`` report, and two
counts kept by this router: requests in flight to it, and requests sent to it
since its last report. Field practice (SGLang router, llm-d) is the source of
the load signals; the estimate below is ours and is described in
``docs/router.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pd_cluster.router.kv_index import PromptTokens
from pd_cluster.router.load import LoadReport


class Candidate(Protocol):
    """What a policy may read about a worker (``router.workers.Worker`` fits)."""

    url: str
    load: LoadReport | None
    inflight: int
    sent_since_report: int


@dataclass(frozen=True)
class RouteRequest:
    """The parts of a request a policy may use.

    ``text``: the prompt as text (chat messages joined), for ``cache_aware``'s
    approximate tree. ``attempt``: 1 for the first try, 2.. for retries.
    ``prompt``: the prompt's token ids as the workers tokenize them (with
    ``--tokenizer-path``), for ``cache_aware`` on the workers' KV events.
    """

    text: str = ""
    attempt: int = 1
    prompt: PromptTokens | None = None


def effective_load(c: Candidate) -> int:
    """Estimated requests at the worker now.

    The worker's last report (running plus every queue) plus what this router
    sent since; this router's in-flight count when no report exists.
    """
    if c.load is None:
        return c.inflight
    return c.load.requests + c.sent_since_report


def live_load(c: Candidate) -> int:
    """Like :func:`effective_load`, but counting of the requests sent since the report only those still in
    flight (at most ``inflight``): a request that already ended there is no load, and a report at most a poll
    period old would otherwise make an idle worker look busy right after it answered."""
    if c.load is None:
        return c.inflight
    return c.load.requests + min(c.sent_since_report, c.inflight)


def estimated_usage(c: Candidate) -> float:
    """Estimated KV usage (0..1) now: reported usage plus what was sent since.

    Each request sent since the report is charged the mean usage of a running
    request, or ``1 / max_running_requests`` when none runs.
    """
    if c.load is None:
        return 0.0
    load = c.load
    if load.num_running_reqs > 0:
        per_request = load.token_usage / load.num_running_reqs
    else:
        per_request = 1.0 / max(1, load.max_running_requests)
    return load.token_usage + c.sent_since_report * per_request


def has_admission_room(c: Candidate) -> bool:
    """True when the worker can admit one more request by its last report.

    Unknown load counts as room (a new worker is assumed empty).
    """
    load = c.load
    if load is None:
        return True
    if load.num_total_pages > 0 and load.num_free_pages <= 0:
        return False
    if load.max_running_requests <= 0:
        return True
    return load.requests + c.sent_since_report < load.max_running_requests


class Policy(ABC):
    """Chooses one worker among candidates; pure and synchronous.

    Implementations never do I/O. ``select`` is given a non-empty sequence and
    returns one of its elements.
    """

    name: str = ""
    needs_load: bool = False

    @abstractmethod
    def select(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        """Return the chosen candidate. Raises ``ValueError`` when empty."""

    def track(self, choice: Candidate, request: RouteRequest) -> Callable[[], None] | None:
        """Called with the worker chosen for an attempt; may return what to call when that worker's part of
        the attempt has ended (``cache_aware`` on KV events)."""
        return None

    def on_worker_removed(self, url: str) -> None:
        """Forget state about a worker that left the registry."""

    def evict(self) -> None:
        """Periodic housekeeping (``cache_aware`` drops idle entries)."""


def require_candidates(candidates: Sequence[Candidate]) -> None:
    """Raise ``ValueError`` on an empty candidate list."""
    if not candidates:
        raise ValueError("no candidate workers")
