"""The generate endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/responses``
(OpenAI's Responses API, served by the workers; its streams are not migrated).

Order of checks, each with its OpenAI-format error: draining (503), API key (401), body size (413), JSON
(400), model (404), prompts over ``--max-prompts-per-request`` (400), admission by cost (429 with
``Retry-After``: a request holds one slot of ``--max-concurrent-requests`` per sequence, ``router.limiter``). Then up to ``--retry-max-retries`` attempts, each
on a fresh pair, with backoff and jitter between them; the whole request runs under
``--request-timeout-secs``. A client that disconnects cancels the request, which closes the upstream
connection, so the worker aborts it and frees its pages.

**Overload** (``router.capacity``): pairs are chosen among workers with room only. When every usable worker
is at capacity, the request waits in the router, in arrival order, until one has room or
``--queue-timeout-secs`` have passed since it arrived, and is then refused with 429 and ``Retry-After``
before anything was sent to the client; at most ``--queue-size`` requests wait (past it, an immediate
429). A worker that refuses a request for capacity (429 or 503, ``router.capacity``) costs the request no attempt:
the worker is left alone for its ``Retry-After`` and the request goes to one that has room, or waits.
A stream that already started is never refused for load: it waits for room up to its request timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable

from pd_cluster.common.request_limits import too_many_sequences
from pd_cluster.router.capacity import CapacityGate
from pd_cluster.router.config import Role, RouterConfig
from pd_cluster.router.errors import error_body, sse_error_event
from pd_cluster.router.exchange import Exchange, bearer_ok, running_loop, valid_request_id
from pd_cluster.router.limiter import ConcurrencyLimiter, Overloaded
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.migration import plan_body
from pd_cluster.router.models import ModelNames
from pd_cluster.router.outcomes import Outcomes
from pd_cluster.router.policies import RouteRequest
from pd_cluster.router.relay import AttemptFailure, Relay, RequestState
from pd_cluster.router.request import InvalidRequest, parse_request
from pd_cluster.router.retry import backoff_seconds, is_retriable_status
from pd_cluster.router.selection import Pair, PairSelector
from pd_cluster.router.supervisor import Supervisor
from pd_cluster.router.tokenizer import RouterTokenizer
from pd_cluster.router.upstream import Upstreams
from pd_cluster.router.workers import Worker

log = logging.getLogger("pd_cluster.router.proxy")

# OpenAI's codes where it has one; else the rejection reason (queue_full, draining...).
_REJECT_CODES = {"unauthorized": "invalid_api_key", "payload_too_large": "request_too_large",
                 "no_workers": "no_healthy_worker"}
_RETRY_AFTER = ((b"retry-after", b"1"),)


def _blamed_urls(pair: Pair, failure: AttemptFailure) -> tuple[str, ...]:
    """The workers of ``pair`` a failure points at (both when it is not known which)."""
    if failure.blame is Role.DECODE or pair.prefill is None:
        return (pair.decode.url,)
    if failure.blame is Role.PREFILL:
        return (pair.prefill.url,)
    return pair.urls()


ENDPOINTS = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat_completions",
             b"/v1/responses": "responses"}


class GenerateHandler:
    """Answers the two generate paths, one `Exchange` at a time each."""

    def __init__(self, config: RouterConfig, selector: PairSelector, limiter: ConcurrencyLimiter,
                 metrics: RouterMetrics, models: ModelNames, upstreams: Upstreams, gate: CapacityGate,
                 tokenizer: RouterTokenizer | None = None,
                 on_failure: Callable[[Worker, AttemptFailure], None] | None = None) -> None:
        """``gate``: where requests wait for a worker with room (the selector's ``on_release`` notifies it);
        ``tokenizer``: the app's, when it routes on KV events; ``on_failure``: told of every failed attempt
        (`Outcomes`)."""
        self.config = config
        self.selector = selector
        self.limiter = limiter
        self.metrics = metrics
        self.models = models
        self.upstreams = upstreams
        self.relay = Relay(metrics, config.limits)
        self.gate = gate
        self.outcomes = Outcomes(metrics, gate, on_failure)
        self.tokenizer = tokenizer
        self.draining = False
        self._rng = random.Random(config.policy.seed)
        self.supervisor = Supervisor()
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count(1)
        self._needs_text = selector.needs_text
        key = config.security.api_key
        self._api_key = key.encode() if key else None

    @property
    def queued(self) -> int:
        """Requests waiting in the router: for an admission slot, or for a worker with room."""
        return self.limiter.queued + len(self.gate)

    def _new_request_id(self) -> str:
        """Unique per router process: a random prefix and a counter (no syscall)."""
        return f"{self._id_prefix}{next(self._id_counter):08x}"

    async def __call__(self, ex: Exchange) -> None:
        endpoint = ENDPOINTS[ex.path]
        rid = valid_request_id(ex.header(b"x-request-id")) or self._new_request_id()
        state: list[RequestState] = []
        status = await self._handle(ex, rid, state)
        self.metrics.count_request(endpoint, status)
        elapsed = time.perf_counter() - ex.arrived
        self.metrics.e2e.observe(elapsed)
        if self.config.enable_log_requests:
            st = state[0] if state else None
            log.info("request finished", extra={
                "request_id": rid, "endpoint": endpoint, "status": status, "latency_s": round(elapsed, 6),
                "prefill": st.prefill_url if st else None, "decode": st.decode_url if st else None,
                "attempts": st.attempts if st else 0})

    def _reject(self, ex: Exchange, status: int, reason: str, message: str, rid: str,
                extra: tuple = ()) -> int:
        self.metrics.rejected.labels(reason).inc()
        if not ex.finished:
            ex.respond(status, error_body(status, message, None, _REJECT_CODES.get(reason, reason)),
                       extra=((b"x-request-id", rid.encode()), *extra))
        return status

    @staticmethod
    def _error(ex: Exchange, status: int, message: str, rid: str, param: str | None = None,
               code: str | None = None) -> int:
        ex.respond(status, error_body(status, message, param, code), extra=((b"x-request-id", rid.encode()),))
        return status

    async def _handle(self, ex: Exchange, rid: str, out_state: list) -> int:
        if self.draining:
            return self._reject(ex, 503, "draining", "the router is shutting down", rid, _RETRY_AFTER)
        if self._api_key is not None and not bearer_ok(ex.header(b"authorization"), self._api_key):
            return self._reject(ex, 401, "unauthorized", "invalid or missing API key", rid,
                                ((b"www-authenticate", b"Bearer"),))
        if ex.too_large or ex.body is None:
            return self._reject(ex, 413, "payload_too_large",
                                f"request body exceeds {self.config.limits.max_payload_size} bytes", rid)
        chat, responses = ex.path == b"/v1/chat/completions", ex.path == b"/v1/responses"
        try:
            parsed = parse_request(ex.body, chat=chat, responses=responses)
        except InvalidRequest as exc:
            return self._error(ex, 400, str(exc), rid, exc.param, exc.code)
        if parsed.model is not None and not self.models.accepts(parsed.model):
            return self._error(ex, 404, f"The model `{parsed.model}` does not exist.", rid, "model",
                               "model_not_found")
        cap = self.config.limits.max_prompts_per_request
        if 0 < cap < parsed.num_prompts:
            return self._error(ex, 400, f"'prompt' holds {parsed.num_prompts} prompts; at most {cap} are accepted "
                               "in one request (--max-prompts-per-request)", rid, "prompt", "invalid_value")
        if not chat and not responses and (message := too_many_sequences(parsed.num_prompts,
                                                                         parsed.num_generated)) is not None:
            # every worker refuses it: before admission, where its cost would wait for the whole router to drain
            return self._error(ex, 400, message, rid, "prompt", "invalid_value")
        state = RequestState(rid, ex.path.decode(), ex.body, parsed, ex.arrived)
        if parsed.stream and self.config.retry.migration_limit > 0 and not responses:
            plan = plan_body(parsed.data, chat, ex.body)
            if plan is not None:
                state.upstream_body, state.tracker = plan
        if self.tokenizer is not None:
            state.prompt = await self.tokenizer.prompt(parsed.chat_data, chat or responses,
                                                       self.selector.index.page_sizes())
        out_state.append(state)
        return await self._admit_and_run(state, ex)

    async def _admit_and_run(self, state: RequestState, ex: Exchange) -> int:
        key, sup = self.supervisor.enter(self.config.limits.request_timeout_secs, running_loop(ex))
        state.supervised = sup
        ex.on_lost = lambda: Supervisor.client_lost(sup)
        try:
            if ex.client_gone:
                raise asyncio.CancelledError()
            cost = state.parsed.cost  # one slot per sequence: prompts x n
            try:
                if not self.limiter.try_acquire(cost):
                    await self.limiter.acquire(cost)
            except Overloaded as exc:
                return self._reject(ex, 429, exc.reason, "too many requests in flight; retry later",
                                    state.request_id, _RETRY_AFTER)
            try:
                return await self._forward(state, ex)
            finally:
                self.limiter.release(cost)
        except asyncio.CancelledError:
            if sup.timed_out:
                sup.task.uncancel()
                return self._timed_out(state, ex)
            if sup.client_gone or ex.client_gone:
                if sup.client_gone:
                    sup.task.uncancel()
                if state.delivered:  # it closed right after [DONE]: the whole answer went out
                    return 200
                log.info("client disconnected; request aborted", extra={"request_id": state.request_id})
                return 499
            raise
        finally:
            self.supervisor.leave(key)

    def _timed_out(self, state: RequestState, ex: Exchange) -> int:
        secs = self.config.limits.request_timeout_secs
        log.warning("request timed out", extra={"request_id": state.request_id, "timeout_s": secs})
        if not state.response_started:
            return self._error(ex, 504, f"request timed out after {secs} s", state.request_id,
                               code="request_timeout")
        if not state.finished:
            ex.end(b"\n\n" + sse_error_event(504, f"request timed out after {secs} s", "request_timeout"))
        return 200

    async def _room(self, state: RequestState, ex: Exchange, first: bool) -> int | None:
        """Wait for a worker with room; None once there may be one, else the refusal's status."""
        sup = state.supervised
        if state.response_started:  # a stream on its way is never refused for load
            deadline = sup.deadline if sup is not None else time.monotonic() + 3600
        else:
            if not first and self.queued >= self.config.limits.queue_size:
                return self._reject(ex, 429, "queue_full", "every worker is at capacity and the router's queue "
                                    "is full; retry later", state.request_id, _RETRY_AFTER)
            deadline = (sup.started if sup is not None else time.monotonic()) + self.config.limits.queue_timeout_secs
        if await self.gate.wait(deadline, first):
            return None
        if state.response_started:
            return 0
        return self._reject(ex, 429, "queue_timeout", "every worker stayed at capacity; retry later",
                            state.request_id, _RETRY_AFTER)

    async def _choose(self, state: RequestState, ex: Exchange, attempt: int,
                      tried: set[str]) -> Pair | int | None:
        """A pair with room (waiting for one while every usable worker is full); the refusal's status if
        the wait ended without room; None when no pair is usable at all."""
        request = RouteRequest(state.parsed.text if self._needs_text else "", attempt, state.prompt)
        woken = False
        while True:
            pair = self.selector.choose(request, tried, state.parsed.cost)
            if pair is not None or not self.selector.may_pair():
                if woken:
                    self.gate.admitted()  # let the next waiter look too
                return pair
            refused = await self._room(state, ex, woken)
            if refused is not None:
                return refused
            woken = True

    async def _forward(self, state: RequestState, ex: Exchange) -> int:
        tried: set[str] = set()
        last: AttemptFailure | None = None
        attempts = self.config.retry.max_attempts
        attempt = 1
        while attempt <= attempts:
            pair = await self._choose(state, ex, attempt, tried)
            if not isinstance(pair, Pair):
                if pair is None:
                    break
                return pair
            result = await self._run_on(pair, state, ex)
            if isinstance(result, AttemptFailure) and result.reason == "token_ids_refused":
                # a worker without return_token_ids: send the client's body as it came, and
                # give up migration for this request
                state.tracker = state.upstream_body = None
                continue
            if not isinstance(result, AttemptFailure):
                return result
            if result.after_start:
                return await self._migrate(state, ex, result, set(_blamed_urls(pair, result)))
            last = result
            if result.overloaded and attempts > 1:  # the refuser is busy now: another worker with room, or a wait
                sup = state.supervised
                if sup is not None and time.monotonic() - sup.started >= self.config.limits.queue_timeout_secs:
                    return self._reject(ex, 429, "queue_timeout", "every worker stayed at capacity; retry later",
                                        state.request_id, _RETRY_AFTER)
                self.metrics.retries.labels(result.reason, result.code).inc()
                state.retries += 1
                continue
            tried.update(pair.urls())
            if attempt < attempts:
                self.metrics.retries.labels(result.reason, result.code).inc()
                state.retries += 1
                await asyncio.sleep(backoff_seconds(self.config.retry, attempt, self._rng))
            attempt += 1
        return self._give_up(state, ex, last)

    async def _run_on(self, pair: Pair, state: RequestState, ex: Exchange, path: str | None = None,
                      body: bytes | None = None) -> int | AttemptFailure:
        """One attempt on ``pair``, with the bookkeeping of choices, breakers and logs."""
        self.outcomes.chosen(pair)
        state.attempts += 1
        state.decode_url = pair.decode.url
        state.prefill_url = pair.prefill.url if pair.prefill else None
        try:
            result = await self.relay.attempt(self.upstreams, state, pair, ex, path, body)
        finally:
            pair.release()
        if isinstance(result, AttemptFailure):
            self.outcomes.failure(pair, result, state)
        else:
            self.outcomes.success(pair)
        return result

    async def _migrate(self, state: RequestState, ex: Exchange, failure: AttemptFailure,
                       tried: set[str]) -> int:
        """The stream broke after it started: continue it on fresh pairs, or end it with an error.

        ``tried``: the workers blamed so far, avoided while others are usable (a healthy prefill
        of the failed pair stays a candidate); the n-th migration after the first waits the
        n-th retry backoff, which gives the health checks time to see dead workers.
        """
        tracker = state.tracker
        limit = self.config.retry.migration_limit
        while tracker is not None and tracker.can_migrate and tracker.migrations < limit:
            if tracker.remaining_max_tokens() == 0:  # every token was relayed: only the end was lost
                state.mark_finished()
                ex.end(tracker.synthetic_end())
                return 200
            if tracker.migrations and not failure.overloaded:
                await asyncio.sleep(backoff_seconds(self.config.retry, tracker.migrations, self._rng))
            pair = await self._choose(state, ex, state.attempts + 1, tried)
            if not isinstance(pair, Pair):
                break
            if not failure.overloaded:
                tracker.migrations += 1
            tracker.continuing = True
            self.metrics.migrations.labels(failure.reason).inc()
            log.warning("migrating request", extra={
                "request_id": state.request_id, "reason": failure.reason,
                "migration": tracker.migrations, "tokens_relayed": tracker.num_relayed,
                "from_decode": state.decode_url, "decode": pair.decode.url,
                "prefill": pair.prefill.url if pair.prefill else None})
            result = await self._run_on(pair, state, ex, state.path, tracker.continuation_body())
            if not isinstance(result, AttemptFailure):
                return result
            if not result.overloaded:
                tried.update(_blamed_urls(pair, result))
            failure = result
            if result.status is not None and not is_retriable_status(result.status) and not result.overloaded:
                break
        message = f"the worker failed mid-stream ({failure.reason})"
        if tracker is not None and tracker.migrations:
            message += f" after {tracker.migrations} migration(s)"
        event = sse_error_event(502, message, "worker_failed_mid_stream")
        if tracker is not None and tracker.death_event:  # a worker's engine died under it and no worker could
            event = tracker.death_event                  # continue it: it ends with that worker's own error
        state.mark_finished()
        ex.end(event if state.clean else b"\n\n" + event)
        return 200

    def forget_worker(self, worker: Worker) -> None:
        """Drop the per-worker metric series and connections of a worker that left the registry."""
        self.metrics.forget_worker(worker.role.value, worker.url)
        self.upstreams.forget(worker.url)

    def _give_up(self, state: RequestState, ex: Exchange, last: AttemptFailure | None) -> int:
        rid = state.request_id
        if last is None:
            return self._reject(ex, 503, "no_workers", "no healthy worker is available", rid, _RETRY_AFTER)
        if last.status is not None and last.body:
            extra = state.id_headers()
            if last.overloaded:  # the worker's refusal for capacity, relayed (retries are off)
                extra += ((b"retry-after", b"%d" % max(1, round(last.retry_after or 1))),)
            ex.respond(last.status, last.body, b"application/json", extra)
            return last.status
        status = last.status or 502
        ex.respond(status, error_body(status, f"all attempts failed; last: {last.reason}", None, last.reason),
                   extra=state.id_headers())
        return status
