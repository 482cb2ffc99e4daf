"""A prefill or decode worker that switches role without reloading its weights (elastic PD).

`SwitchableWorker` is the ASGI app of a ``pd-worker --role prefill|decode``: it serves the current role's app
(`pd_cluster.prefill.server.build_prefill_app` or `pd_cluster.decode.server.build_decode_app`, each with its
server, KV sender or receiver, NIXL agent, metrics and engine thread) over one `LLMEngine` (weights, KV pool,
prefix cache), and answers the router's internal ``POST /role`` ``{"role": "decode", "timeout_secs": 600}``
(``router.role_switch`` calls it; the internal key is required when the cluster has one):

1. **stop**: ``/health`` turns 503 (the router has already stopped routing to it in the old role);
2. **drain**: wait until nothing of the old role is left: no HTTP call in flight (a decode's streams, a
   prefill's ``/prefill`` jobs), no request in the engine, no KV push or receive outstanding, every page free
   (cached pages count as free: they are evictable, and stay valid KV for either role);
3. **tear down** the old role's parts: its server, engine thread and transfer agent (the NIXL agent deregisters
   the pool); the engine stays open;
4. **set up** the new role: `LLMEngine.set_role`, then the new role's app over the same engine, with a fresh
   transfer agent (a new incarnation, so peers that knew the old agent refresh their metadata, as after a
   restart), started as at launch (a decode worker meets its ``--prefill-urls`` before it reports ready);
5. answer 200 with the timings; the router re-registers the worker under the new role.

A switch that cannot drain before its deadline is given up before anything is torn down (504, the worker takes
work in its old role again). Refused with 409 ``role_switch_unsupported``, naming the flag: tensor parallelism,
the hierarchical cache, speculative decoding and the KV store (their parts are not re-set-up yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse

from pd_cluster.serving.errors import HTTPError, error_body
from pd_cluster.serving.worker_app import WorkerConfig, key_matches, presented_key

logger = logging.getLogger("pd.worker.role")

ROLE_PATH = "/role"
SWITCHABLE_ROLES = ("prefill", "decode")
SETTLE_S = 0.05  # the worker must stay idle this long before its role's parts are torn down (late arrivals)
POLL_S = 0.01


def config_for_role(base: WorkerConfig, role: str) -> WorkerConfig:
    """`base` (the launch config) in `role`: a decode worker's ``--prefill-url(s)`` are kept only when it was
    launched as decode."""
    keep = role == "decode" and base.role == "decode"
    return dataclasses.replace(base, role=role, engine=dataclasses.replace(base.engine, role=role),
                               prefill_url=base.prefill_url if keep else None,
                               prefill_urls=base.prefill_urls if keep else ())


def unsupported(engine, config: WorkerConfig) -> str | None:
    """Why this worker cannot switch role (the flag that makes it so), else None."""
    ec = config.engine
    if ec.parallel.tp_size > 1:
        return "--tp-size > 1: tensor-parallel workers do not switch role yet"
    if getattr(engine, "host_tier", None) is not None:
        return "--enable-hierarchical-cache: the host tier is kept by the prefill role only"
    if ec.speculative.enabled:
        return "--speculative-algorithm: speculative workers do not switch role yet"
    if getattr(engine, "l3", None) is not None:
        return "--hicache-storage-backend: KV-store workers do not switch role yet"
    return None


SWITCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class SwitchMetrics(Collector):
    """``pd:role_switches_total{from_role,to_role}`` and ``pd:role_switch_duration_seconds`` (drain to serving, on
    the worker) of one worker process, kept across its switches: registered on each role app's registry in turn."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.counts: dict[tuple[str, str], list[int]] = {}  # (from, to) -> bucket counts, +Inf last
        self.sums: dict[tuple[str, str], float] = {}

    def observe(self, old: str, new: str, secs: float) -> None:
        counts = self.counts.setdefault((old, new), [0] * (len(SWITCH_BUCKETS) + 1))
        counts[next((i for i, b in enumerate(SWITCH_BUCKETS) if secs <= b), len(SWITCH_BUCKETS))] += 1
        self.sums[(old, new)] = self.sums.get((old, new), 0.0) + secs

    def collect(self):
        labels = ["model_name", "from_role", "to_role"]
        total = CounterMetricFamily("pd:role_switches", "Role switches of this worker (elastic PD).", labels=labels)
        hist = HistogramMetricFamily("pd:role_switch_duration_seconds", "A role switch on the worker, from the "
                                     "router's call to the new role serving (drain, teardown, set-up).",
                                     labels=labels)
        for (old, new), counts in sorted(self.counts.items()):
            lv = [self.model_name, old, new]
            total.add_metric(lv, sum(counts))
            cumulative, running = [], 0
            for bound, count in zip((*SWITCH_BUCKETS, float("inf")), counts):
                running += count
                cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
            hist.add_metric(lv, cumulative, self.sums[(old, new)])
        yield total
        yield hist


class SwitchableWorker:
    """The ASGI app of a prefill or decode worker; see the module docstring.

    Args:
        engine: the worker's `LLMEngine` (kept across switches).
        config: the launch config.
        build: makes the role app of a config over `engine` (the role builder, with the internal key's
            middleware).
    """

    def __init__(self, engine, config: WorkerConfig, build: Callable[[WorkerConfig], Any]) -> None:
        self.engine = engine
        self.base = config
        self.config = config
        self._build = build
        self.metrics = SwitchMetrics(engine.model_name)
        self.app: Any = self._role_app(config)
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        self.inflight = 0  # HTTP calls other than GET now in the role's app: a decode's streams, /prefill jobs
        self.switches = 0

    def _role_app(self, config: WorkerConfig):
        app = self._build(config)
        app.state.worker.registry.register(self.metrics)
        return app

    @property
    def state(self):
        """The current role app's ``state`` (its ``worker`` is the role's `WorkerState`), as a role app's."""
        return self.app.state

    # ---- ASGI ---------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] == "http" and scope.get("path") == ROLE_PATH:
            return await self._role(scope, receive, send)
        app = self.app
        if app is None:  # between two roles: nothing is served
            if scope["type"] == "http":
                body = error_body(503, "the worker is switching role", None, "switching_role")
                await JSONResponse(body, 503, headers={"Retry-After": "1"})(scope, receive, send)
            return
        counted = scope["type"] == "http" and scope.get("method") != "GET"
        self.inflight += counted
        try:
            await app(scope, receive, send)
        finally:
            self.inflight -= counted

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._start()
                except BaseException as e:  # noqa: BLE001 - uvicorn reports it and exits
                    await send({"type": "lifespan.startup.failed", "message": repr(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.app is not None:
                    await self._stop(close_engine=True)
                else:
                    self.engine.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _start(self) -> None:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.app.router.lifespan_context(self.app))
        self._stack = stack

    async def _stop(self, close_engine: bool) -> None:
        """Stop the current role's app (its lifespan's end); nothing is served until the next `_start`."""
        app, self.app = self.app, None  # calls that arrive meanwhile get 503, never a stopping engine loop
        app.state.worker.close_engine = close_engine
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # ---- POST /role ---------------------------------------------------------------------------------------
    async def _role(self, scope, receive, send) -> None:
        try:
            if scope.get("method") != "POST":
                raise HTTPError(405, f"method {scope.get('method')} not allowed on {ROLE_PATH}", None,
                                "method_not_allowed")
            key = self.config.internal_api_key
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if key and not key_matches(presented_key(headers), key):
                raise HTTPError(401, "this endpoint needs the cluster's internal key (X-PD-Internal-Key)", None,
                                "invalid_internal_key")
            role, timeout = _parse(await _read_body(receive))
            out = await self.switch(role, timeout)
            response = JSONResponse(out)
        except HTTPError as e:
            response = JSONResponse(e.body(), e.status, headers=e.headers or None)
        await response(scope, receive, send)

    async def switch(self, role: str, timeout_s: float) -> dict[str, Any]:
        """Switch to `role` (the module docstring's steps); returns the timings.

        Raises:
            HTTPError: 400 bad role, 409 a switch under way or an unsupported configuration, 504 the drain did not
                end within `timeout_s`, 500 the new role could not be set up (the old one is restored).
        """
        if role not in SWITCHABLE_ROLES:
            raise HTTPError(400, f"role must be 'prefill' or 'decode', got {role!r}", "role", "invalid_value")
        if self._lock is None:
            self._lock = asyncio.Lock()
        if self._lock.locked() or self.app is None:
            raise HTTPError(409, "a role switch is already under way", None, "switch_in_progress")
        async with self._lock:
            old = self.config.role
            if role == old:
                return {"role": role, "switched": False, "switches": self.switches}
            why = unsupported(self.engine, self.config)
            if why is not None:
                raise HTTPError(409, f"this worker cannot switch role: {why}", None, "role_switch_unsupported")
            t0 = time.monotonic()
            state = self.app.state.worker
            state.stop_taking_work()
            logger.info("role switch %s -> %s: draining", old, role)
            try:
                await self._drain(state, t0 + timeout_s)
            except BaseException:
                state.resume_taking_work()
                raise
            t1 = time.monotonic()
            await self._stop(close_engine=False)
            t2 = time.monotonic()
            try:
                self.engine.set_role(role)
                new_config = config_for_role(self.base, role)
                self.app = self._role_app(new_config)
                await self._start()
                self.config = new_config
            except Exception as e:  # noqa: BLE001 - the old role comes back, the caller gets a 500
                logger.exception("role switch %s -> %s failed: restoring %s", old, role, old)
                await self._restore(old)
                raise HTTPError(500, f"setting up the {role} role failed ({type(e).__name__}: {e}); "
                                f"the worker serves {old} again", None, "role_switch_failed") from None
            t3 = time.monotonic()
            self.switches += 1
            self.metrics.observe(old, role, t3 - t0)
            out = {"role": role, "from_role": old, "switched": True, "switches": self.switches,
                   "drain_secs": round(t1 - t0, 4), "teardown_secs": round(t2 - t1, 4),
                   "setup_secs": round(t3 - t2, 4), "total_secs": round(t3 - t0, 4),
                   "kv_incarnation": self.app.state.worker.info.get("kv_incarnation")}
            logger.info("role switch %s -> %s done in %.3f s (drain %.3f s, teardown %.3f s, set-up %.3f s)",
                        old, role, t3 - t0, t1 - t0, t2 - t1, t3 - t2)
            return out

    async def _restore(self, role: str) -> None:
        """Serve `role` again after a failed set-up (the engine is idle: nothing was admitted meanwhile)."""
        if self.app is not None:
            await self._stop(close_engine=False)
        if self.engine.role != role:
            self.engine.set_role(role)
        config = config_for_role(self.base, role)
        self.app = self._role_app(config)
        await self._start()
        self.config = config

    def _idle(self, state) -> bool:
        load = state.load
        return (self.inflight == 0 and not self.engine.requests and load["num_running_reqs"] == 0
                and load["num_queue_reqs"] == 0 and load["num_free_pages"] == load["num_total_pages"]
                and not any(state.extra_load().values()))

    async def _drain(self, state, deadline: float) -> None:
        """Wait until the role has nothing left (`_idle` for `SETTLE_S` in a row).

        Raises:
            HTTPError: 504 ``switch_timeout`` past `deadline`.
        """
        quiet_since = None
        while True:
            now = time.monotonic()
            if self._idle(state):
                quiet_since = now if quiet_since is None else quiet_since
                if now - quiet_since >= SETTLE_S:
                    return
            else:
                quiet_since = None
            if now > deadline:
                load = state.load
                raise HTTPError(504, f"the worker did not drain in time ({self.inflight} HTTP call(s), "
                                f"{load['num_running_reqs']} running, {load['num_queue_reqs']} queued, "
                                f"{load['num_total_pages'] - load['num_free_pages']} page(s) held); it keeps its "
                                f"role", None, "switch_timeout")
            await asyncio.sleep(POLL_S)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _parse(raw: bytes) -> tuple[str, float]:
    """``{"role": ..., "timeout_secs": ...}`` -> (role, timeout).

    Raises:
        HTTPError: 400 naming the field.
    """
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise HTTPError(400, "the body is not JSON", None, "invalid_json") from None
    if not isinstance(body, dict) or not isinstance(body.get("role"), str):
        raise HTTPError(400, "role: required, 'prefill' or 'decode'", "role", "invalid_value")
    timeout = body.get("timeout_secs", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise HTTPError(400, "timeout_secs: a number of seconds in (0, 3600]", "timeout_secs", "invalid_value")
    return body["role"], float(timeout)
