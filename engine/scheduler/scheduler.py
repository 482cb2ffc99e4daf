"""The token-budget scheduler (vLLM v1's model) in the prefill, decode or mixed role.

Every step spends a token budget (``max_prefill_tokens``): running requests
first, in arrival order, each computing the tokens it lacks (1 for a decode,
up to ``chunked_prefill_size`` for a prompt chunk); then waiting requests,
first come first served within a client request and round robin across client
requests (`WaitingQueue`: a many-prompt request does not hold back the requests
sent after it), while the budget, ``max_running_requests`` and admission control
allow. Pages
are taken on demand. When a running request cannot grow, unreferenced cached
pages are evicted first; only then is the most recently admitted running
request retracted: its pages are freed and it goes back to the front of the
queue to be recomputed (SGLang's retraction, vLLM's recompute preemption).

Prefix cache (`pd_cluster.engine.kv.prefix_cache`): a request admitted to
compute locally starts on its longest cached prefix of full pages, with
``num_computed_tokens`` at that length; its last known token is always
computed so that there are logits to sample. Requests asking for prompt
logprobs skip the lookup (they need the logits of every prompt position).
After every step the pages it completed join the cache.

Roles:
- ``mixed``: prefill and decode locally.
- ``prefill``: a request ends after its first token; its pages stay held
  (``PREFILLED``) until the worker, its KV pushed, calls `release`. Cached
  pages are part of its block table like computed ones, so they are pushed too.
- ``decode``: remote requests get pages for their prompt at admission
  (``WAITING_FOR_REMOTE_KV``), starting on their longest cached prefix (as a
  local request's, capped before the last token): only the rest is reserved,
  and the worker has the prefill worker fill only those pages, then calls
  `complete_remote_prefill` with the first token; the arrived pages join the
  cache. When the uncached rest is at most ``max_local_prefill_length`` tokens
  the request is prefilled here instead (``local_prefills``; Dynamo's
  conditional disaggregation). A retracted request is recomputed locally.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from pd_cluster.engine.config import SchedulerConfig
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.engine.scheduler.admission import AdmissionPolicy
from pd_cluster.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from pd_cluster.engine.scheduler.page_manager import PageManager
from pd_cluster.engine.scheduler.waiting import WaitingQueue

if TYPE_CHECKING:
    from pd_cluster.engine.spec.drafter import Drafter

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which tokens of which requests to compute.

    Args:
        config: scheduler settings (budget, chunk size, limits).
        pages: page manager over the pool's allocator.
        role: ``mixed``, ``prefill`` or ``decode``.
        max_running_requests: resolved limit of the running batch.
        on_leave: called with every request that leaves the running set (finished, aborted, retracted, held
            for a transfer) and with every removed request; the engine frees its block-table row there.
        drafter: speculative decoding's drafter (`pd_cluster.engine.spec.drafter`): a decoding request it gives
            draft tokens is scheduled as a verify (its last token and the drafts, one extend); None: off.
    """

    def __init__(self, config: SchedulerConfig, pages: PageManager, role: str, max_running_requests: int,
                 on_leave: Callable[[Request], None] | None = None, drafter: "Drafter | None" = None) -> None:
        self.config = config
        self.pages = pages
        self.role = role
        self.max_running = max_running_requests
        self.admission = AdmissionPolicy(config.schedule_conservativeness)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}      # decode role: awaiting their KV
        self.held: dict[str, Request] = {}        # finished but pages held: written only by this class
        self.num_retracted_total = 0
        self.on_leave = on_leave
        self.drafter = drafter if role != "prefill" else None
        self._cost = pages.pool_tokens if pages.grouped else None  # admission in pool tokens (hybrid KV)
        # longrope's original_max_position_embeddings (`rope.longrope_threshold`), None without longrope: a
        # request whose KV was rotated by the short factors is recomputed when it grows past it
        self.long_rope_from: int | None = None

    def _left(self, req: Request) -> None:
        if self.on_leave is not None:
            self.on_leave(req)

    # ---- queue management ----------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_holding(self) -> int:
        """Requests that hold pages and count against ``max_running_requests``."""
        return len(self.running) + len(self.remote)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def remove(self, req: Request, release_pages: bool = True) -> bool:
        """Take `req` out of every queue; free its pages, or hold them until `release`.

        Args:
            release_pages: False when something may still read or write the pages
                (a NIXL transfer): a request holding pages is then kept in `held`.

        Returns:
            True when `req` is now held.
        """
        if req in self.running:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.remote.pop(req.request_id, None)
        self.held.pop(req.request_id, None)
        self._left(req)
        if release_pages or not req.block_table:
            self.pages.release(req)
            return False
        self.held[req.request_id] = req
        return True

    def release(self, request_id: str) -> Request | None:
        """Free the pages of a held request; returns it, or None when `request_id` is not held."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.pages.release(req)
        return req

    # ---- the step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_prefill_tokens
        budget = self._schedule_running(out, budget)
        if not out.retracted:
            self._schedule_waiting(out, budget)
        if not self.running and not self.waiting:
            self.admission.on_idle()
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        return min(req.num_tokens - req.num_computed_tokens, self.config.chunked_prefill_size, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: set[str] = set()
        if self.drafter is not None:  # STANDALONE: the draft model runs once for every decoding request
            self.drafter.prepare([r for r in self.running if r.status == RequestStatus.RUNNING
                                  and r.num_tokens - r.num_computed_tokens == 1
                                  and r.num_computed_tokens >= r.num_prompt_tokens])
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # retracted earlier in this loop
                continue
            if req.num_inflight and req.num_output_tokens + req.num_inflight >= req.max_tokens:
                continue  # overlap scheduling: its token in flight is its last (max_tokens); nothing to run
            if self._outgrew_short_rope(req):  # recomputed with the long factors, as transformers does
                self._requeue(req)
                out.recomputed.append(req)
                continue
            self.pages.trim(req)  # window pages behind the next query go back to the pool first
            n = self._chunk(req, budget)
            if n <= 0:
                continue
            draft = self._draft(req, n, budget)
            if not self._make_room(req, req.num_computed_tokens + n, scheduled, out):
                continue
            if draft and self.pages.can_grow(req, req.num_computed_tokens + n + len(draft)):
                n += len(draft)  # drafts never retract anyone: without room the request decodes one token
            else:
                draft = []
            self.pages.grow(req, req.num_computed_tokens + n)
            item = ScheduledRequest(req, req.num_computed_tokens, n, draft)
            decoding = n == 1 and req.num_computed_tokens >= req.num_prompt_tokens
            (out.verifies if draft else out.decodes if decoding else out.prefills).append(item)
            scheduled.add(req.request_id)
            budget -= n
        return budget

    def _draft(self, req: Request, n: int, budget: int) -> list[int]:
        """Speculative decoding: draft tokens for a decoding request (one token to compute), else []."""
        if self.drafter is None or n != 1 or req.num_computed_tokens < req.num_prompt_tokens:
            return []
        return self.drafter.propose(req, budget - 1)

    def _make_room(self, req: Request, num_tokens: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Retract the newest running requests until `req` can hold `num_tokens`.

        Returns False when `req` itself had to wait (prefill role) or was retracted.
        """
        while not self.pages.can_grow(req, num_tokens):
            if self.role == "prefill":
                return False  # never retract work whose pages may be on the wire; wait for frees
            victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), None)
            if victim is None:
                return False
            self._retract(victim, out)
            if victim is req:
                return False
        return True

    def _outgrew_short_rope(self, req: Request) -> bool:
        """`req`'s KV is rotated by longrope's short factors and it now has more tokens than the factors serve."""
        return self.long_rope_from is not None and not req.rope_variant and req.num_tokens > self.long_rope_from

    def _retract(self, req: Request, out: SchedulerOutput) -> None:
        self._requeue(req)
        req.num_retractions += 1
        out.retracted.append(req)
        self.num_retracted_total += 1

    def _requeue(self, req: Request) -> None:
        """Free a running request's pages and put it first in the queue, to be recomputed locally (also in the
        decode role), with longrope's factors for its length now."""
        self.running.remove(req)
        self._left(req)
        self.pages.release(req)
        req.num_computed_tokens = 0
        if self.long_rope_from is not None:
            req.rope_variant = int(req.num_tokens > self.long_rope_from)
        req.remote_kv = False
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        reserved = (self.admission.reserved_tokens(self.running, self._cost)
                    + self.admission.reserved_tokens(self.remote.values(), self._cost))
        while self.waiting and self.num_holding < self.max_running:
            req = self.waiting[0]
            cached = self._match(req)
            need = self.admission.tokens_needed(req, self._cost)  # after the match: cached tokens are not needed
            remote = req.remote_kv and req.num_tokens - cached > self.config.max_local_prefill_length
            if remote:
                admitted = self._fits(need, reserved) and self._reserve_remote(req, out)
                n = 0
            else:
                n = self._chunk(req, budget)
                admitted = (self._fits(need, reserved) and n > 0
                            and self.pages.can_grow(req, req.num_computed_tokens + n))
            if not admitted:
                self.pages.release(req)  # give the matched pages back
                req.num_computed_tokens = 0
                break
            if not remote:
                if req.remote_kv:  # conditional disaggregation: this worker prefills the short rest itself
                    req.remote_kv = False
                    out.local_prefills.append(req)
                self.pages.grow(req, req.num_computed_tokens + n)
                self.waiting.popleft()
                self._admit(req)
                out.prefills.append(ScheduledRequest(req, req.num_computed_tokens, n))
                budget -= n
            self._count_cached(req, cached, out)
            reserved += need

    def _fits(self, need: int, reserved: float) -> bool:
        """Admission: a new request fits when the running ones keep their reservation (always, when alone)."""
        return not self.num_holding or need <= self.pages.free_tokens - reserved

    def _match(self, req: Request) -> int:
        """Start a request that holds no pages on its cached prefix; returns the cached tokens."""
        if req.params.prompt_logprobs is not None or req.num_inflight:
            return 0
        cached = self.pages.match(req)
        req.num_computed_tokens = cached
        return cached

    def _count_cached(self, req: Request, cached: int, out: SchedulerOutput) -> None:
        out.num_cached_tokens += cached
        if req.num_cached_tokens is None:  # first admission (a retracted request is not counted again)
            req.num_cached_tokens = min(cached, req.num_prompt_tokens)
            if self.pages.cache is not None and req.params.prompt_logprobs is None:
                loaded = self.pages.host_hit_tokens(req)
                stored = self.pages.stored_hit_tokens(req)
                out.prefix_cache_queries += req.num_tokens
                out.prefix_cache_hits += cached - loaded - stored
                if self.pages.has_host_tier:
                    out.host_cache_queries += req.num_tokens
                    out.host_cache_hits += loaded + stored
                    out.storage_cache_hits += stored

    def _reserve_remote(self, req: Request, out: SchedulerOutput) -> bool:
        """Reserve pages for every known token beyond the matched prefix (`num_computed_tokens` until the KV
        arrives): the prompt and any resumed output, whose KV the prefill worker computes too."""
        if not self.pages.can_reserve_remote(req):
            return False
        self.pages.reserve_remote(req)
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        req.times.admitted = req.times.admitted or time.monotonic()
        out.reserved.append(req)
        out.reserved_cached_tokens += req.num_computed_tokens  # the matched prefix
        return True

    def _admit(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        req.times.admitted = req.times.admitted or time.monotonic()
        self.running.append(req)

    # ---- after the forward pass -------------------------------------------------
    def on_step_launched(self, out: SchedulerOutput) -> None:
        """The step's forward pass is issued: advance every scheduled request's ``num_computed_tokens``.

        With overlap scheduling the next step is scheduled before this one's results are known, on this
        progress (vLLM v1 also advances it at scheduling time); the KV is final only at `on_step_done`.
        """
        for item in out.scheduled:
            item.req.num_computed_tokens = item.known_end  # a verify's drafts count once accepted (`on_verified`)
        self._update_admission(out)
        out.launched = True

    def _update_admission(self, out: SchedulerOutput) -> None:
        """The admission rule's state after a step (before the next one is scheduled)."""
        if out.decodes or out.verifies:
            self.admission.on_decode_step()
        if out.retracted:
            self.admission.on_retract(self.running)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The step's forward pass completed: the pages it filled join the prefix cache.

        Only up to the step's own end (a later step may be in flight) and only for requests still running
        (one retracted or ended meanwhile gave its pages back).
        """
        for item in out.scheduled:
            req = item.req
            if req.status == RequestStatus.RUNNING:
                req.num_computed_tokens = max(req.num_computed_tokens, item.known_end)  # no-op after on_step_launched
                self.pages.cache_computed(req, item.known_end)
        if not out.launched:
            self._update_admission(out)

    def on_verified(self, item: ScheduledRequest, num_accepted: int) -> None:
        """A verify completed with `num_accepted` drafts accepted (their tokens are about to be appended): their
        KV is kept, the rejected drafts' slots are rolled back, and pages held only for rejected drafts go back to
        the pool (the request holds what it would hold without speculation). Nothing rejected is ever cached.
        """
        req = item.req
        if req.status != RequestStatus.RUNNING:
            return
        req.num_computed_tokens = item.known_end + num_accepted
        self.pages.shrink(req, req.num_computed_tokens)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """`req` stopped: free its pages (or, in the prefill role, hold them for the push).

        Under overlap scheduling a request retracted while its last step was in flight is in the queue.
        """
        if req in self.running:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._left(req)
        if self.role == "prefill" and status != RequestStatus.FINISHED_ABORTED:
            req.status = RequestStatus.PREFILLED
            self.held[req.request_id] = req
            return
        req.status = status
        self.pages.release(req)

    def complete_remote(self, req: Request) -> None:
        """Decode role: `req`'s prompt KV (and its resumed output's) arrived; it joins the running batch and its
        full pages the cache."""
        self.remote.pop(req.request_id)
        req.num_computed_tokens = req.num_tokens
        self.pages.cache_computed(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

