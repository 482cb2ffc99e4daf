"""Control-plane endpoints (FastAPI): health, readiness, metrics, models, admin API.

``GET /health`` is liveness (503 once draining); ``GET /readiness`` says
whether a request could be routed now. ``/v1/models`` needs the API key (as
vLLM's ``--api-key``, only ``/v1/*`` does; ``--api-key-protects-all-paths``
extends it to every path but ``/health`` and ``/readiness``);
``/workers`` needs the admin key: when ``--admin-api-key`` is unset the admin
API is open only if ``--api-key`` is unset too (a router with an API key never
leaves its admin API open).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from pd_cluster.router.config import Role, RouterConfig
from pd_cluster.router.errors import error_body
from pd_cluster.router.health import HealthMonitor
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.text_map import TextMap
from pd_cluster.router.metrics import RouterMetrics
from pd_cluster.router.models import ModelNames
from pd_cluster.router.openapi import document_generate_routes, error_responses
from pd_cluster.router.role_switch import RoleSwitcher, SwitchRefused
from pd_cluster.router.workers import Worker, WorkerRegistry, normalize_url


OPEN_PATHS = ("/health", "/readiness")
"""What ``--api-key-protects-all-paths`` leaves open: the probes (``/workers`` has the admin key)."""


class AddWorker(BaseModel):
    url: str
    role: Role


class RemoveWorker(BaseModel):
    url: str


class SwitchRole(BaseModel):
    role: str
    timeout_secs: float = Field(default=600.0, gt=0, le=3600)


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status,
                    media_type="application/json", headers=headers)


def _param(loc: tuple | list) -> str | None:
    """``("body", "url")`` -> ``"url"``; ``("query", "url")`` -> ``"url"``."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def _bearer(request: Request) -> bytes:
    value = request.headers.get("authorization", "")
    return value[7:].strip().encode() if value[:7].lower() == "bearer " else b""


class ControlPlane:
    """Builds the FastAPI app over the router's live objects."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, monitor: HealthMonitor,
                 metrics: RouterMetrics, models: ModelNames,
                 is_draining: Callable[[], bool], can_route: Callable[[], bool],
                 kv_index: KvIndex | None = None, text_map: TextMap | None = None,
                 switcher: RoleSwitcher | None = None) -> None:
        self.config = config
        self.switcher = switcher or RoleSwitcher(config, registry, monitor, metrics)
        self._switches: set[asyncio.Task] = set()  # switches under way (kept referenced until done)
        self.kv_index = kv_index
        self.text_map = text_map
        self.registry = registry
        self.monitor = monitor
        self.metrics = metrics
        self.models = models
        self.is_draining = is_draining
        self.can_route = can_route
        self.started = int(time.time())
        sec = config.security
        self._api_key = sec.api_key.encode() if sec.api_key else None
        self._admin_key = sec.admin_api_key.encode() if sec.admin_api_key else None
        self._all_paths = sec.api_key_protects_all_paths and self._api_key is not None

    def _check_api_key(self, request: Request) -> None:
        if self._api_key is not None and not hmac.compare_digest(_bearer(request), self._api_key):
            raise HTTPException(401, "invalid or missing API key",
                                headers={"www-authenticate": "Bearer"})

    def _check_admin(self, request: Request) -> None:
        if self._admin_key is not None:
            if not hmac.compare_digest(_bearer(request), self._admin_key):
                raise HTTPException(401, "invalid or missing admin API key")
        elif self._api_key is not None:
            raise HTTPException(403, "the admin API is disabled: set --admin-api-key")

    def build(self) -> FastAPI:
        app = FastAPI(title="pd-router", version="1", docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json",
                      description="OpenAI-compatible router of a pd-cluster deployment.")

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
            status, message = exc.status_code, str(exc.detail)
            if status == 404 and message == "Not Found":
                message = f"no route {request.method} {request.url.path}"
            headers = getattr(exc, "headers", None)
            if status == 405:
                message = f"method {request.method} not allowed on {request.url.path}"
                # Starlette names the methods of the first route on the path; a path served by several routes
                # (POST and DELETE /workers/{id}/drain) allows them all (RFC 9110 section 15.5.6)
                allowed = sorted({m for r in app.router.routes if isinstance(r, Route)
                                  and r.matches(request.scope)[0] is not Match.NONE for m in r.methods or ()})
                if allowed:
                    headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            return _error(status, message, headers=headers)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> Response:
            errors = exc.errors()
            first = errors[0] if errors else {}
            param = _param(first.get("loc", ()))
            message = "; ".join(f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg')}"
                                for e in errors[:5]) or "invalid request"
            return _error(400, message, param)

        document_generate_routes(app)

        if self._all_paths:
            @app.middleware("http")
            async def _every_path_needs_the_key(request: Request, call_next) -> Response:
                path = request.url.path
                if path not in OPEN_PATHS and not path.startswith("/workers") \
                        and not hmac.compare_digest(_bearer(request), self._api_key):
                    return _error(401, "invalid or missing API key", code="invalid_api_key",
                                  headers={"www-authenticate": "Bearer"})
                return await call_next(request)

        @app.get("/health", responses=error_responses(503))
        async def health() -> Response:
            if self.is_draining():
                return _error(503, "draining")
            return JSONResponse({"status": "ok"})

        @app.get("/readiness", responses=error_responses(503))
        async def readiness() -> Response:
            if self.is_draining() or not self.can_route():
                return _error(503, "no usable worker pair")
            return JSONResponse({"status": "ready"})

        @app.get("/metrics", response_class=Response, responses={200: {
            "description": "Prometheus text format",
            "content": {"text/plain; version=0.0.4; charset=utf-8": {"schema": {"type": "string"}}}}})
        async def metrics() -> Response:
            return Response(self.metrics.render(),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/version")
        async def version() -> Response:
            return JSONResponse({"version": package_version()})

        @app.get("/v1/models", responses=error_responses(401))
        async def models(request: Request) -> Response:
            self._check_api_key(request)
            return JSONResponse(self._models_body())

        for path in ("/tokenize", "/detokenize"):
            app.add_api_route(path, self._forward_tokenizer_call, methods=["POST"],
                              responses=error_responses(400, 401, 502, 503))
        app.add_api_route("/tokenizer_info", self._forward_tokenizer_call, methods=["GET"],
                          responses=error_responses(401, 502, 503))

        self._admin_routes(app)
        return app

    async def _forward_tokenizer_call(self, request: Request) -> Response:
        """``/tokenize``, ``/detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes): answered by any usable decode
        or mixed worker, whose status and body are passed through (they hold the tokenizer; the router does
        not). Open to clients without the API key, as vLLM's (lm-eval's remote tokenizer sends none), unless
        ``--api-key-protects-all-paths``."""
        workers = self.registry.usable(Role.DECODE) + self.registry.usable(Role.MIXED)
        if not workers:
            return _error(503, "no healthy worker to tokenize with", code="no_healthy_worker")
        key = self.config.security.internal_api_key
        headers = {"Content-Type": "application/json", **({"X-PD-Internal-Key": key} if key else {})}
        timeout = httpx.Timeout(30.0, connect=self.config.limits.connect_timeout_secs)
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                r = await client.request(request.method, workers[0].url + request.url.path,
                                         content=await request.body(), headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"worker {workers[0].url} did not answer: {type(exc).__name__}",
                          code="worker_unreachable")
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))

    def _models_body(self) -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": self.started, "owned_by": "pd-cluster",
                 "root": name, "parent": None} for name in self.models.names()]
        return {"object": "list", "data": data}

    def _describe(self, worker: Worker, now: float) -> dict[str, Any]:
        """A worker's ``/workers`` entry; with KV events, its index: ``synced``, ``fresh``, ``instance_id``,
        ``seq`` (the last event applied), ``pages``; for a worker whose text-to-page map is polled,
        ``text_map``: ``fresh``, ``instance_id``, ``seq`` (the last entry applied)."""
        out = worker.describe(now)
        w = self.kv_index.get(worker.url) if self.kv_index is not None else None
        if w is not None:
            out["kv_index"] = {"synced": w.synced, "fresh": self.kv_index.fresh(worker.url, now),
                               "instance_id": w.instance_id, "seq": w.seq, "pages": len(w.blocks)}
        source = self.text_map.source(worker.url) if self.text_map is not None else None
        if source is not None:
            out["text_map"] = {"fresh": now - source.polled_at <= self.text_map.stale_secs,
                               "instance_id": source.instance_id, "seq": source.seq}
        return out

    def _admin_routes(self, app: FastAPI) -> None:
        @app.get("/workers")
        async def list_workers(request: Request) -> Response:
            self._check_admin(request)
            now = time.monotonic()
            return JSONResponse({"workers": [self._describe(w, now) for w in self.registry.all()]})

        @app.post("/workers")
        async def add_worker(request: Request, body: AddWorker) -> Response:
            self._check_admin(request)
            try:
                existed = self.registry.get(normalize_url(body.url)) is not None
                worker = self.registry.add(body.url, body.role, "admin")
            except ValueError as exc:
                raise HTTPException(400, str(exc)) from None
            if not existed:
                await self.monitor.check(worker)
            return JSONResponse(worker.describe(time.monotonic()), status_code=200 if existed else 201)

        @app.delete("/workers")
        async def remove_worker(request: Request, url: str | None = None) -> Response:
            self._check_admin(request)
            if url is None:
                try:
                    url = RemoveWorker.model_validate_json(await request.body()).url
                except ValueError:
                    raise HTTPException(400, "give the worker as ?url= or {\"url\": ...}") from None
            try:
                removed = self.registry.remove(url)
            except ValueError as exc:
                raise HTTPException(400, str(exc)) from None
            if removed is None:
                raise HTTPException(404, f"no worker {url}")
            return JSONResponse({"removed": removed.url})

        @app.post("/workers/{worker_id}/role", responses=error_responses(400, 401, 403, 404, 409, 502, 504))
        async def switch_role(request: Request, worker_id: str, body: SwitchRole) -> Response:
            """Switch a prefill worker to decode or back without reloading its weights (``router.role_switch``);
            answers once it serves the new role."""
            self._check_admin(request)
            # shielded: a caller that goes away does not leave the worker half-switched in the registry
            task = asyncio.ensure_future(self.switcher.switch(worker_id, body.role, body.timeout_secs))
            self._switches.add(task)
            task.add_done_callback(self._switches.discard)
            try:
                out = await asyncio.shield(task)
            except SwitchRefused as e:
                if e.body is not None:
                    return Response(e.body, status_code=e.status, media_type="application/json")
                return _error(e.status, e.message, e.param, e.code)
            return JSONResponse(out)

        @app.post("/workers/{worker_id}/drain", responses=error_responses(400, 401, 403, 404, 409, 504))
        async def drain(request: Request, worker_id: str, timeout_secs: float = 600.0) -> Response:
            """Stop routing new work to a worker and answer once this router's requests on it have left it
            (``RoleSwitcher.drain``): the first half of a scale-down."""
            self._check_admin(request)
            task = asyncio.ensure_future(self.switcher.drain(worker_id, timeout_secs))
            self._switches.add(task)
            task.add_done_callback(self._switches.discard)
            try:
                return JSONResponse(await asyncio.shield(task))
            except SwitchRefused as e:
                return _error(e.status, e.message, e.param, e.code)

        @app.delete("/workers/{worker_id}/drain", responses=error_responses(401, 403, 404))
        async def undrain(request: Request, worker_id: str) -> Response:
            """Give a drain up: the worker takes new work again."""
            self._check_admin(request)
            worker = self.registry.by_id(worker_id)
            if worker is None:
                return _error(404, f"no worker with id {worker_id!r}", "id", "worker_not_found")
            worker.draining = False
            self.registry.touch()
            return JSONResponse(worker.describe(time.monotonic()))


def package_version() -> str:
    """pd-cluster's installed version (the workers' ``/version`` answers the same), else ``0.1.0+source``."""
    try:
        return importlib.metadata.version("pd-cluster")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+source"
