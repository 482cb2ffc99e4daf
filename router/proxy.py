"""The generate endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Order of checks, each with its OpenAI-format error: API key (401), body size
(413), JSON (400), model (404), admission (429 with ``Retry-After``). Then up
to ``--retry-max-retries`` attempts, each on a fresh pair, with backoff and
jitter between them; the whole request runs under ``--request-timeout-secs``.
A client that disconnects cancels the request, which closes the upstream
connection, so the worker aborts it and frees its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable

from pd_cluster.router.asgi import BodyTooLarge, Receive, Scope, Send, bearer_ok, header, read_body, send_bytes
from pd_cluster.router.asgi import send_error, valid_request_id
from pd_cluster.router.config import Role, RouterConfig
from pd_cluster.router.errors import sse_error_event
from pd_cluster.router.limiter import ConcurrencyLimiter, Overloaded
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.models import ModelNames
from pd_cluster.router.policies import RouteRequest
from pd_cluster.router.migration import plan_body
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

def _blamed_urls(pair: Pair, failure: AttemptFailure) -> tuple[str, ...]:
    """The workers of ``pair`` a failure points at (both when it is not known which)."""
    if failure.blame is Role.DECODE or pair.prefill is None:
        return (pair.decode.url,)
    if failure.blame is Role.PREFILL:
        return (pair.prefill.url,)
    return pair.urls()


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}


class GenerateHandler:
    """Raw-ASGI handler of the two generate paths."""

    def __init__(self, config: RouterConfig, selector: PairSelector, limiter: ConcurrencyLimiter,
                 metrics: RouterMetrics, models: ModelNames, upstreams: Upstreams) -> None:
        self.config = config
        self.selector = selector
        self.limiter = limiter
        self.metrics = metrics
        self.models = models
        self.upstreams = upstreams
        self.relay = Relay(metrics, config.limits)
        self.tokenizer: RouterTokenizer | None = None  # set by the app when routing on KV events
        self.draining = False
        self.on_failure: Callable[[Worker, AttemptFailure], None] | None = None
        self._rng = random.Random(config.policy.seed)
        self.supervisor = Supervisor()
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_counter = itertools.count(1)
        self._choice_inc: dict[tuple[str, str], Callable[[], None]] = {}
        key = config.security.api_key
        self._api_key = key.encode() if key else None

    def _new_request_id(self) -> str:
        """Unique per router process: a random prefix and a counter (no syscall)."""
        return f"{self._id_prefix}{next(self._id_counter):08x}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()
        endpoint = ENDPOINTS[scope["path"]]
        rid = valid_request_id(header(scope, b"x-request-id")) or self._new_request_id()
        state: list[RequestState] = []
        status = await self._handle(scope, receive, send, rid, arrived, state)
        self.metrics.count_request(endpoint, status)
        elapsed = time.perf_counter() - arrived
        self.metrics.e2e.observe(elapsed)
        if self.config.enable_log_requests:
            st = state[0] if state else None
            log.info("request finished", extra={
                "request_id": rid, "endpoint": endpoint, "status": status, "latency_s": round(elapsed, 6),
                "prefill": st.prefill_url if st else None, "decode": st.decode_url if st else None,
                "attempts": st.attempts if st else 0})

    async def _reject(self, send: Send, status: int, reason: str, message: str, rid: str,
                      extra: tuple = ()) -> int:
        self.metrics.rejected.labels(reason).inc()
        await send_error(send, status, message, rid, extra=extra,
                         code=_REJECT_CODES.get(reason, reason))
        return status

    async def _handle(self, scope: Scope, receive: Receive, send: Send, rid: str,
                      arrived: float, out_state: list) -> int:
        if self.draining:
            return await self._reject(send, 503, "draining", "the router is shutting down", rid)
        if self._api_key is not None and not bearer_ok(scope, self._api_key):
            return await self._reject(send, 401, "unauthorized", "invalid or missing API key", rid,
                                      ((b"www-authenticate", b"Bearer"),))
        try:
            body = await read_body(scope, receive, self.config.limits.max_payload_size)
        except BodyTooLarge:
            return await self._reject(send, 413, "payload_too_large",
                                      f"request body exceeds {self.config.limits.max_payload_size}"
                                      " bytes", rid)
        except ConnectionResetError:
            return 499
        try:
            parsed = parse_request(body, chat=scope["path"] == "/v1/chat/completions")
        except InvalidRequest as exc:
            await send_error(send, 400, str(exc), rid, param=exc.param, code=exc.code)
            return 400
        if parsed.model is not None and not self.models.accepts(parsed.model):
            await send_error(send, 404, f"The model `{parsed.model}` does not exist.", rid,
                             param="model", code="model_not_found")
            return 404
        state = RequestState(rid, scope["path"], body, parsed, arrived)
        if self.config.retry.migration_limit > 0 and parsed.stream:
            plan = plan_body(parsed.data, chat=scope["path"] == "/v1/chat/completions")
            if plan is not None:
                state.upstream_body, state.tracker = plan
        if self.tokenizer is not None:
            state.prompt = await self.tokenizer.prompt(parsed.data, scope["path"] == "/v1/chat/completions",
                                                       self.selector.index.page_sizes())
        out_state.append(state)
        return await self._admit_and_run(state, receive, send)

    async def _admit_and_run(self, state: RequestState, receive: Receive, send: Send) -> int:
        key, sup = self.supervisor.enter(receive, self.config.limits.request_timeout_secs)
        state.supervised = sup
        try:
            try:
                await self.limiter.acquire()
            except Overloaded as exc:
                return await self._reject(send, 429, exc.reason, "too many requests in flight; "
                                          "retry later", state.request_id,
                                          ((b"retry-after", b"1"),))
            try:
                return await self._forward(state, send)
            finally:
                self.limiter.release()
        except asyncio.CancelledError:
            if sup.timed_out:
                sup.task.uncancel()
                return await self._timed_out(state, send)
            if sup.client_gone:
                sup.task.uncancel()
                log.info("client disconnected; request aborted",
                         extra={"request_id": state.request_id})
                return 499
            raise
        finally:
            self.supervisor.leave(key)

    async def _timed_out(self, state: RequestState, send: Send) -> int:
        secs = self.config.limits.request_timeout_secs
        log.warning("request timed out", extra={"request_id": state.request_id, "timeout_s": secs})
        if not state.response_started:
            await send_error(send, 504, f"request timed out after {secs} s", state.request_id,
                             code="request_timeout")
            return 504
        if not state.finished:
            event = sse_error_event(504, f"request timed out after {secs} s", "request_timeout")
            await send({"type": "http.response.body", "body": b"\n\n" + event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200

    async def _forward(self, state: RequestState, send: Send) -> int:
        tried: set[str] = set()
        last: AttemptFailure | None = None
        attempts = self.config.retry.max_attempts
        for attempt in range(1, attempts + 1):
            pair = self.selector.choose(RouteRequest(state.parsed.text, attempt, state.prompt), tried)
            if pair is None:
                break
            result = await self._run_on(pair, state, send)
            if isinstance(result, AttemptFailure) and result.reason == "token_ids_refused":
                # a worker without return_token_ids: send the client's body as it came, and
                # give up migration for this request
                state.tracker = state.upstream_body = None
                pair = self.selector.choose(RouteRequest(state.parsed.text, attempt, state.prompt), tried)
                if pair is None:
                    break
                result = await self._run_on(pair, state, send)
            if not isinstance(result, AttemptFailure):
                return result
            if result.after_start:
                return await self._migrate(state, send, result, set(_blamed_urls(pair, result)))
            tried.update(pair.urls())
            last = result
            if attempt < attempts:
                self.metrics.retries.labels(result.reason).inc()
                await asyncio.sleep(backoff_seconds(self.config.retry, attempt, self._rng))
        return await self._give_up(state, send, last)

    async def _run_on(self, pair: Pair, state: RequestState, send: Send, path: str | None = None,
                      body: bytes | None = None) -> int | AttemptFailure:
        """One attempt on ``pair``, with the bookkeeping of choices, breakers and logs."""
        self._count_choice(pair)
        state.attempts += 1
        state.decode_url = pair.decode.url
        state.prefill_url = pair.prefill.url if pair.prefill else None
        try:
            result = await self.relay.attempt(self.upstreams.data, state, pair, send, path, body)
        finally:
            pair.release()
        if isinstance(result, AttemptFailure):
            self._record_failure(pair, result, state, state.attempts)
        else:
            self._record_success(pair)
        return result

    async def _migrate(self, state: RequestState, send: Send, failure: AttemptFailure,
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
                await send({"type": "http.response.body", "body": tracker.synthetic_end(),
                            "more_body": True})
                state.mark_finished()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return 200
            if tracker.migrations:
                await asyncio.sleep(backoff_seconds(self.config.retry, tracker.migrations,
                                                    self._rng))
            pair = self.selector.choose(RouteRequest(state.parsed.text, state.attempts + 1, state.prompt), tried)
            if pair is None:
                break
            tracker.migrations += 1
            tracker.continuing = True
            self.metrics.migrations.labels(failure.reason).inc()
            log.warning("migrating request", extra={
                "request_id": state.request_id, "reason": failure.reason,
                "migration": tracker.migrations, "tokens_relayed": len(tracker.generated),
                "from_decode": state.decode_url, "decode": pair.decode.url,
                "prefill": pair.prefill.url if pair.prefill else None})
            result = await self._run_on(pair, state, send, state.path,
                                        tracker.continuation_body())
            if not isinstance(result, AttemptFailure):
                return result
            tried.update(_blamed_urls(pair, result))
            failure = result
            if result.status is not None and not is_retriable_status(result.status):
                break
        message = f"the worker failed mid-stream ({failure.reason})"
        if tracker is not None and tracker.migrations:
            message += f" after {tracker.migrations} migration(s)"
        event = sse_error_event(502, message, "worker_failed_mid_stream")
        await send({"type": "http.response.body", "more_body": True,
                    "body": event if state.clean else b"\n\n" + event})
        state.mark_finished()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200

    def forget_worker(self, worker: Worker) -> None:
        """Drop the per-worker metric series of a worker that left the registry."""
        key = (worker.role.value, worker.url)
        if self._choice_inc.pop(key, None) is not None:
            self.metrics.worker_requests.remove(*key)

    def _count_choice(self, pair: Pair) -> None:
        for worker in (pair.decode, pair.prefill):
            if worker is None:
                continue
            key = (worker.role.value, worker.url)
            inc = self._choice_inc.get(key)
            if inc is None:
                inc = self.metrics.worker_requests.labels(*key).inc
                self._choice_inc[key] = inc
            inc()

    def _record_success(self, pair: Pair) -> None:
        now = time.monotonic()
        pair.decode.breaker.record_success(now)
        if pair.prefill is not None:
            pair.prefill.breaker.record_success(now)

    def _record_failure(self, pair: Pair, failure: AttemptFailure, state: RequestState,
                        attempt: int) -> None:
        now = time.monotonic()
        blamed = None
        if failure.blame is Role.DECODE:
            blamed = pair.decode
        elif failure.blame is Role.PREFILL:
            blamed = pair.prefill or pair.decode  # a mixed worker fails on its own
        if blamed is not None:
            blamed.breaker.record_failure(now)
        if self.on_failure is not None:
            suspects = [blamed] if blamed is not None else \
                [w for w in (pair.decode, pair.prefill) if w is not None and failure.ambiguous]
            for worker in suspects:
                self.on_failure(worker, failure)
        role = failure.blame.value if failure.blame is not None else "none"
        self.metrics.upstream_failures.labels(role, failure.reason).inc()
        log.warning("stream broke after the first token" if failure.after_start
                    else "attempt failed", extra={
            "request_id": state.request_id, "attempt": attempt, "reason": failure.reason,
            "blamed": role, "code": failure.detail if failure.status else None,
            "decode": pair.decode.url, "prefill": pair.prefill.url if pair.prefill else None,
            "detail": failure.detail})

    async def _give_up(self, state: RequestState, send: Send, last: AttemptFailure | None) -> int:
        rid = state.request_id
        if last is None:
            return await self._reject(send, 503, "no_workers",
                                      "no healthy worker is available", rid)
        if last.status is not None and last.body:
            await send_bytes(send, last.status, last.body, b"application/json",
                             ((b"x-request-id", rid.encode()),))
            return last.status
        status = last.status or 502
        await send_error(send, status, f"all attempts failed; last: {last.reason}", rid,
                         code=last.reason)
        return status
