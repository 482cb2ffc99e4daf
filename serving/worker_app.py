"""The HTTP app every worker runs: ``/health``, ``/get_load``, ``/server_info``, ``/metrics``, plus role routes.

Built on Starlette routes inside FastAPI; the engine loop starts and stops with
the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.serving.engine_loop import EngineLoop

logger = logging.getLogger("pd.worker")


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
        self.draining = False

    @property
    def load(self) -> dict[str, Any]:
        """Current load, read without stopping the engine (counters only; a step may be mid-way)."""
        return dict(self.loop.engine.load(), **self.extra_load())


def create_worker_app(state: WorkerState, routes: list[tuple[str, Callable, list[str]]],
                      on_startup: Callable[[], Any] | None = None,
                      on_shutdown: Callable[[], Any] | None = None) -> FastAPI:
    """A FastAPI app with the common endpoints and `routes` ((path, handler(request), methods))."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        if on_startup is not None:
            await _maybe_await(on_startup())
        logger.info("worker ready: role=%s model=%s", state.info.get("role"), state.info.get("model"))
        try:
            yield
        finally:
            state.draining = True
            state.loop.stop()
            if on_shutdown is not None:
                await _maybe_await(on_shutdown())
            state.loop.engine.close()  # stops tensor-parallel ranks, if any

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    async def health(request: Request) -> Response:
        if state.draining or not state.loop.alive:
            reason = "draining" if state.draining else "engine loop is not running"
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def get_load(request: Request) -> Response:
        return JSONResponse(state.load)

    async def server_info(request: Request) -> Response:
        return JSONResponse(dict(state.info, draining=state.draining))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    for path, handler, methods in [("/health", health, ["GET"]), ("/get_load", get_load, ["GET"]),
                                   ("/server_info", server_info, ["GET"]), ("/metrics", metrics, ["GET"])] + routes:
        app.add_route(path, handler, methods=methods)
    return app


async def _maybe_await(x: Any) -> Any:
    if asyncio.iscoroutine(x):
        return await x
    return x


def server_info(engine: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
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
    }, **(extra or {}))
