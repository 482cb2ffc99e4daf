"""The HTTP app every worker runs: ``/health``, ``/get_load``, ``/server_info``, ``/metrics``, plus role routes.

Built on Starlette routes inside FastAPI; the engine loop starts and stops with
the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.engine.config import ROLES, EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import StepOutput
from pd_cluster.serving.engine_loop import EngineLoop, StepHooks
from pd_cluster.serving.errors import HTTPError, error_body, install_error_handlers
from pd_cluster.serving.openapi import package_version, worker_openapi
from pd_cluster.serving.tools.chat import ToolSettings
from pd_cluster.transfer.config import TransferConfig

logger = logging.getLogger("pd.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process runs with; built from ``pd-worker`` flags by
    `pd_cluster.launch.worker.worker_config_from_args`, taken by the role apps.

    Attributes:
        role: ``prefill``, ``decode`` or ``mixed``.
        host, port: where the HTTP server listens.
        advertise_url: the URL peers and the router use to reach this worker (``http://host:port`` by default).
        prefill_url: decode only: the prefill worker of requests without an ``X-PD-Prefill-Url`` header.
        log_level: the level of the worker's log (``info``, ``debug``, ...).
        timeout_graceful_shutdown: seconds requests in flight get to finish on SIGTERM.
        engine: the engine's config (its `role` equals `role`).
        transfer: the KV transfer agent's config (prefill and decode roles).
        internal_api_key: the cluster's shared internal key (``--internal-api-key`` / ``PD_INTERNAL_API_KEY``):
            required on ``/prefill``, ``/abort`` and ``/kv_transfer/*`` (`InternalAuth`), and sent on the
            worker's own calls to its peers. None: no check (a trusted network only).
        internal_api_key_protects_v1: also require the key on ``/v1/*`` (the router sends it; a direct
            client sends it as ``Authorization: Bearer``).
        prefill_urls: decode only: the prefill workers a request's ``X-PD-Prefill-Url`` may name without the
            internal key (``--prefill-urls``; `prefill_url` is always allowed).
        tools: ``--tool-call-parser`` and ``--enable-auto-tool-choice`` (the OpenAI API of decode and mixed
            workers).
    """

    role: str = "mixed"
    host: str = "127.0.0.1"
    port: int = 30000
    advertise_url: str | None = None
    prefill_url: str | None = None
    log_level: str = "info"
    timeout_graceful_shutdown: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    internal_api_key: str | None = field(default=None, repr=False)
    internal_api_key_protects_v1: bool = False
    prefill_urls: tuple[str, ...] = ()
    tools: ToolSettings = field(default_factory=ToolSettings)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.engine.role != self.role:
            raise ValueError(f"the engine's role {self.engine.role!r} is not the worker's {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.timeout_graceful_shutdown < 0:
            raise ValueError(f"timeout_graceful_shutdown must be >= 0, got {self.timeout_graceful_shutdown}")
        if self.prefill_url is not None and self.role != "decode":
            raise ValueError("prefill_url is a decode worker's setting")
        if self.prefill_urls and self.role != "decode":
            raise ValueError("prefill_urls is a decode worker's setting")
        if self.internal_api_key is not None and not self.internal_api_key.strip():
            raise ValueError("internal_api_key must be unset or non-empty")
        if self.internal_api_key_protects_v1 and not self.internal_api_key:
            raise ValueError("internal_api_key_protects_v1 needs an internal_api_key")

    @property
    def internal_headers(self) -> dict[str, str]:
        """Headers of this worker's calls to its peers (``/prefill``, ``/abort``, ``/kv_transfer/info``)."""
        return {INTERNAL_KEY_HEADER: self.internal_api_key} if self.internal_api_key else {}

    @property
    def url(self) -> str:
        """The URL this worker is reached at."""
        return self.advertise_url or f"http://{self.host}:{self.port}"


INTERNAL_KEY_HEADER = "X-PD-Internal-Key"
"""The header carrying the cluster's internal key on worker-internal calls."""

INTERNAL_PATHS = ("/prefill", "/abort", "/kv_transfer/", "/kv_events", "/kv_text_map")
"""Worker-internal endpoints: only the cluster's own processes call them."""


def key_matches(presented: str | None, key: str | None) -> bool:
    """True when `presented` equals `key` (compared in constant time); False when either is missing."""
    if not presented or not key:
        return False
    return hmac.compare_digest(presented.encode(), key.encode())


def presented_key(headers) -> str | None:
    """The internal key a request carries: ``X-PD-Internal-Key``, else ``Authorization: Bearer``."""
    value = headers.get(INTERNAL_KEY_HEADER.lower())
    if value:
        return value
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


class InternalAuth:
    """ASGI middleware: worker-internal endpoints (and, with `protect_v1`, the client API: ``/v1/*``,
    ``/tokenize``, ``/detokenize``) need the internal key.

    A call without a key is answered 401, one with a wrong key 403, both in OpenAI's error format; the
    check is constant-time (`hmac.compare_digest`). ``/health``, ``/metrics`` and the other read-only
    endpoints stay open for probes and scrapers.
    """

    def __init__(self, app, key: str, protect_v1: bool = False) -> None:
        self.app = app
        self.key = key
        self.prefixes = INTERNAL_PATHS + (("/v1/", "/tokenize", "/detokenize") if protect_v1 else ())

    def protects(self, path: str) -> bool:
        return path.startswith(self.prefixes) or path.rstrip("/") in INTERNAL_PATHS

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.protects(scope.get("path", "")):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        presented = presented_key(headers)
        if key_matches(presented, self.key):
            return await self.app(scope, receive, send)
        status = 401 if not presented else 403
        message = ("this endpoint needs the cluster's internal key (X-PD-Internal-Key)" if status == 401 else
                   "the internal key is not valid")
        logger.warning("refused %s %s from %s: %s", scope.get("method"), scope.get("path"),
                       (scope.get("client") or ("?",))[0], message)
        response = JSONResponse(error_body(status, message, None, "invalid_internal_key"), status_code=status,
                                headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
        await response(scope, receive, send)


def install_internal_auth(app: FastAPI, config: WorkerConfig) -> FastAPI:
    """Add `InternalAuth` to `app` when `config` has an internal key (before the app starts); returns `app`."""
    if config.internal_api_key:
        app.add_middleware(InternalAuth, key=config.internal_api_key,
                           protect_v1=config.internal_api_key_protects_v1)
    return app


class WorkerState:
    """What the common endpoints report.

    Args:
        loop: the engine loop.
        registry: the worker's Prometheus registry.
        info: static `/server_info` fields.
        extra_load: adds role-specific numbers to `/get_load` (queue depths).
    """

    def __init__(self, loop: EngineLoop, registry: CollectorRegistry, info: dict[str, Any],
                 extra_load: Callable[[], dict[str, Any]] | None = None) -> None:
        self.loop = loop
        self.registry = registry
        self.info = info
        self.extra_load = extra_load or (lambda: {})
        self._stopping = False
        self.starting: str | None = None  # why the worker is not ready yet (``/health`` answers 503 meanwhile)
        self.close_engine = True  # False: the app's shutdown leaves the engine open (a role switch re-uses it)

    @property
    def draining(self) -> bool:
        """The worker takes no new work: it is shutting down, or its engine loop died."""
        return self._stopping or self.loop.fatal is not None

    def stop_taking_work(self) -> None:
        self._stopping = True

    def resume_taking_work(self) -> None:
        """Undo `stop_taking_work` (a role switch that was given up before the role's parts were torn down)."""
        self._stopping = False

    @property
    def load(self) -> dict[str, Any]:
        """Current load, read without stopping the engine (counters only; a step may be mid-way)."""
        return dict(self.loop.engine.load(), **self.loop.progress, **self.extra_load())


ENGINE_DEAD_EXIT_CODE = 70
"""Exit status of a worker whose engine loop died (``EX_SOFTWARE`` of sysexits.h)."""

FATAL_GRACE_S = 1.0
"""Seconds between failing the requests in flight and exiting, so their error answers reach the clients."""


WorkerAppBuilder = Callable[[LLMEngine, WorkerConfig, dict[str, Any] | None, bool], FastAPI]
"""The one signature of the role apps (`pd_cluster.serving.mixed.build_mixed_app`,
`pd_cluster.prefill.server.build_prefill_app`, `pd_cluster.decode.server.build_decode_app`):
``build(engine, config, host_info=None, exit_on_fatal=True)``; `host_info` adds `/server_info` fields
(``url``, ``incarnation``), `exit_on_fatal` is `worker_engine_loop`'s."""


def worker_engine_loop(engine: LLMEngine, hooks: StepHooks | None = None,
                       on_step: Callable[[LLMEngine, StepOutput, float], None] | None = None,
                       exit_on_fatal: bool = True) -> EngineLoop:
    """A worker's engine thread. When it dies, the loop fails every request in flight and `/health` turns 503;
    with `exit_on_fatal` the process then exits with `ENGINE_DEAD_EXIT_CODE` after `FATAL_GRACE_S`, so that
    pd-serve, Ray or Kubernetes restarts it (an in-process test app passes False and only turns unhealthy)."""

    def exit_soon(error: BaseException) -> None:
        asyncio.get_running_loop().call_later(FATAL_GRACE_S, _exit_dead, engine, error)

    return EngineLoop(engine, hooks, on_step=on_step, on_fatal=exit_soon if exit_on_fatal else None)


def create_worker_app(state: WorkerState, routes: list[tuple[str, Callable, list[str]]],
                      on_startup: Callable[[], Any] | None = None,
                      on_shutdown: Callable[[], Any] | None = None) -> FastAPI:
    """A FastAPI app with the common endpoints and `routes` ((path, handler(request), methods)).

    Every error is answered in OpenAI's format (`errors.install_error_handlers`); ``/openapi.json``
    describes the app (`openapi.worker_openapi`). The engine loop starts and stops with the app.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        if on_startup is not None:
            await _maybe_await(on_startup())
        logger.info("worker ready: role=%s model=%s", state.info.get("role"), state.info.get("model"))
        try:
            yield
        finally:
            state.stop_taking_work()
            state.loop.stop()
            if on_shutdown is not None:
                await _maybe_await(on_shutdown())
            if state.close_engine:
                state.loop.engine.close()  # stops tensor-parallel ranks, if any

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = state
    install_error_handlers(app)

    async def health(request: Request) -> Response:
        # Readiness: 503 while the worker cannot take new work (starting, draining, engine dead). The progress
        # counters tell a router that a slow answer comes from a busy worker, not a stalled one.
        if state.draining or not state.loop.alive:
            reason = "engine loop is not running" if not state.loop.alive else "draining"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        if state.starting is not None:
            return JSONResponse({"status": "starting", "reason": state.starting, **state.loop.progress},
                                status_code=503)
        return JSONResponse({"status": "ok", **state.loop.progress})

    async def get_load(request: Request) -> Response:
        return JSONResponse(state.load)

    async def server_info(request: Request) -> Response:
        return JSONResponse(dict(state.info, draining=state.draining))

    async def expert_distribution(request: Request) -> Response:
        stats = await asyncio.to_thread(state.loop.engine.expert_distribution)
        return JSONResponse({"enabled": False} if stats is None else stats)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": package_version()})

    async def kv_events(request: Request) -> Response:
        since, limit = _int_param(request, "since", None), _int_param(request, "limit", 4096)
        if limit < 1:
            raise HTTPError(400, "limit: must be >= 1", "limit", "invalid_value")
        log = state.loop.engine.kv_events  # a snapshot can take a while: read it off the event loop
        batch = await asyncio.to_thread(log.read, since, limit)
        return JSONResponse(batch.to_json(request.query_params.get("token_ids") != "false",
                                          request.query_params.get("hashes") == "packed"))

    all_routes = [("/health", health, ["GET"]), ("/get_load", get_load, ["GET"]),
                  ("/server_info", server_info, ["GET"]), ("/metrics", metrics, ["GET"]),
                  ("/version", version, ["GET"]), ("/kv_events", kv_events, ["GET"]),
                  ("/expert_distribution", expert_distribution, ["GET"])] + routes
    document = worker_openapi(state.info.get("role", "mixed"), [path for path, _, _ in all_routes])

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    for path, handler, methods in all_routes + [("/openapi.json", openapi, ["GET"])]:
        app.add_route(path, handler, methods=methods)
    return app


def _int_param(request: Request, name: str, default: int | None) -> int | None:
    """A query parameter as a non-negative integer below 2**63, else `default` when absent.

    Raises:
        HTTPError: 400 ``invalid_value`` when present and not such an integer.
    """
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise HTTPError(400, f"{name}: must be a non-negative integer", name, "invalid_value")
    return int(raw)


def _exit_dead(engine: LLMEngine, error: BaseException) -> None:
    """Exit the process now: the engine loop is dead and cannot be restarted in place."""
    logger.critical("engine loop died (%s): exiting with status %d so that the worker is restarted",
                    error, ENGINE_DEAD_EXIT_CODE)
    try:
        engine.close()  # stops tensor-parallel ranks, if any
    except Exception:  # noqa: BLE001 - exiting anyway
        logger.exception("closing the engine failed")
    logging.shutdown()
    os._exit(ENGINE_DEAD_EXIT_CODE)


async def _maybe_await(x: Any) -> Any:
    if asyncio.iscoroutine(x):
        return await x
    return x


def server_info(engine: LLMEngine, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Static `/server_info` fields of a worker running `engine`."""
    layout = engine.layout
    return dict({
        "role": engine.role,
        "model": engine.config.model.path,
        "served_model_name": engine.model_name,
        "model_identity": engine.loaded.identity,
        "page_size": layout.page_size,
        "kv_cache_dtype": layout.kv_cache_dtype,
        "max_total_num_tokens": engine.pool.max_total_num_tokens,
        "context_length": engine.context_length,
        "max_running_requests": engine.max_running_requests,
        "layout_hash": layout.hash(),
        "tp_size": layout.tp_size,
        "prefill_context_parallel_size": engine.config.parallel.prefill_context_parallel_size,
        **({"kv_groups": list(layout.kv_groups)} if layout.kv_groups else {}),
        **({"kv_store": {"backend": engine.l3.backend.name, "key_prefix": engine.l3.namespace.prefix}}
           if getattr(engine, "l3", None) is not None else {}),
    }, **(extra or {}))
