"""The prefill worker's HTTP server: ``POST /prefill`` and ``POST /abort`` for decode workers.

``POST /prefill`` (from a decode worker; `PrefillRequest`) carries the
prompt, the sampling parameters of the first token, the decode worker's URL
and its ticket. The handler loads the decode agent's metadata (cached per
incarnation; the layout handshake runs off the engine thread and refuses
mismatches by name), queues the job, and answers once every push is complete
(`PrefillResponse`: push count, bytes, timings, cached prompt tokens; the first token rode the last
push's notification). The connection stays open meanwhile: if decode goes
away, the job is aborted (one INFO line). Errors are OpenAI-format bodies: 400 (the engine refused the
prompt), 409 (stale peer incarnation or layout mismatch), 502 (decode's
metadata unreachable or the transfer failed), 503 (queue full), 504 (push deadline).
"""

from __future__ import annotations

import asyncio
import logging
import json
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pd_cluster.common.deadline import DEADLINE_HEADER, Deadline
from pd_cluster.disagg.errors import transfer_http_error
from pd_cluster.disagg.peers import CONNECT_PATH, connect_failure, connect_peer, connect_route
from pd_cluster.disagg.prefill_api import ABORT_PATH, PATH, PrefillRequest, PrefillResponse, PrefillTimings
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.serving.errors import HTTPError
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.openai_serving import until_disconnect
from pd_cluster.serving.worker_app import WorkerConfig, WorkerState, create_worker_app, server_info, worker_engine_loop
from pd_cluster.prefill.jobs import ChunkDelay, PrefillHooks, PrefillJob
from pd_cluster.transfer.errors import TransferAbortedError
from pd_cluster.transfer.factory import make_worker_transfer
from pd_cluster.transfer.http import PeerDirectory, make_router
from pd_cluster.transfer.interfaces import Agent
from pd_cluster.transfer.ticket import Ticket

logger = logging.getLogger("pd.prefill")

CLIENT_CLOSED = 499  # nginx's "client closed request": decode went away; nobody reads this answer
DEFAULT_DEADLINE_S = 600.0  # how long a /prefill job may wait for its decode worker without X-PD-Deadline-Ms


class PrefillServer:
    """Handlers of the prefill role."""

    def __init__(self, engine: LLMEngine, loop: EngineLoop, hooks: PrefillHooks, agent: Agent,
                 directory: PeerDirectory, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.loop = loop
        self.hooks = hooks
        self.agent = agent
        self.directory = directory
        self.metrics = metrics
        self.bootstrapping = 0

    async def prefill(self, request: Request) -> Response:
        rid = "?"
        try:
            job_req = PrefillRequest.from_json(await request.body())
            rid = job_req.request_id
        except ClientDisconnect:  # decode gave up while sending the job: nothing was queued, nobody reads this
            logger.info("prefill job: decode closed the connection before its body arrived")
            return Response(status_code=CLIENT_CLOSED)
        except ValueError as e:
            return _error(HTTPError(400, str(e), getattr(e, "param", None), "invalid_job"), rid)
        sender = self.hooks.sender
        deadline = Deadline.from_header(request.headers.get(DEADLINE_HEADER), DEFAULT_DEADLINE_S)
        try:
            await self._connect(job_req.decode_url, job_req.ticket, deadline)
            aloop = asyncio.get_running_loop()
            job = PrefillJob(rid, job_req.ticket, aloop.create_future(), aloop)
            sender.announce(job_req.ticket)  # heartbeats name it while it waits for a long step to end
            await self.loop.call(lambda e: self.hooks.start(e, job, list(job_req.prompt_token_ids),
                                                            job_req.sampling, list(job_req.resumed_output_ids)))
        except asyncio.CancelledError:  # the server is stopping or decode went away during the handshake
            sender.withdraw_announced(job_req.ticket.transfer_id)
            self.loop.call_soon(lambda e: self.hooks.abort(e, rid, "decode closed the prefill request"))
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:  # noqa: BLE001 - every refusal is an OpenAI-format error body
            sender.withdraw_announced(job_req.ticket.transfer_id)
            return _error(connect_failure(e, "decode"), rid)
        try:
            result = await until_disconnect(request, job.future)
        except asyncio.CancelledError:
            self.loop.call_soon(lambda e: self.hooks.abort(e, rid, "decode closed the prefill request"))
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(result.error, TransferAbortedError):  # decode gave up on it (already logged once, at INFO)
            return Response(status_code=CLIENT_CLOSED)
        if result.error is not None:
            return _error(transfer_http_error(result.error), rid)
        self.metrics.queue_time.observe(result.queue_s)
        self.metrics.prefill_time.observe(result.prefill_s)
        self.metrics.prefill_requests.inc()  # the decode worker that finishes the request counts its success
        body = PrefillResponse(rid, result.num_pushes, result.nbytes,
                               PrefillTimings(result.queue_s, result.prefill_s, result.push_tail_s),
                               result.num_cached_tokens)
        return JSONResponse(body.to_dict())

    async def _connect(self, decode_url: str, ticket: Ticket, deadline: Deadline) -> None:
        """Load decode's agent (cached per incarnation; the handshake runs off the engine thread), retrying
        slowness until `deadline` (`connect_peer`)."""
        self.bootstrapping += 1
        self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrapping)
        try:
            await connect_peer(self.agent, self.directory, decode_url, deadline,
                               lambda fn: self.loop.call(lambda e: fn()), expected_agent=ticket.decode_agent)
        finally:
            self.bootstrapping -= 1
            self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrapping)

    async def abort(self, request: Request) -> Response:
        try:
            rid = str(json.loads(await request.body())["request_id"])
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            return _error(HTTPError(400, f"malformed abort: {e!r}"), "?")
        self.loop.call_soon(lambda e: self.hooks.abort(e, rid, "aborted by decode"))
        return JSONResponse({"request_id": rid, "aborted": True})


def _error(err: HTTPError, rid: str) -> Response:
    if err.status >= 500 or err.status == 409:
        logger.warning("prefill %s failed: %s %s", rid, err.status, err.message)
    return JSONResponse(err.body(), status_code=err.status, headers={"X-Request-Id": rid, **err.headers})


def build_prefill_app(engine: LLMEngine, config: WorkerConfig, host_info: dict[str, Any] | None = None,
                      exit_on_fatal: bool = True) -> FastAPI:
    """A FastAPI app for `engine` in the prefill role, with its transfer agent
    (`pd_cluster.serving.worker_app.WorkerAppBuilder`: the signature of every role's app)."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "prefill", engine.model_name)
    tconfig = config.transfer
    agent, sender = make_worker_transfer(engine, "prefill", tconfig, registry)
    hooks = PrefillHooks(sender, engine.device, ChunkDelay.from_env())
    loop = worker_engine_loop(engine, hooks, lambda e, out, dt: metrics.on_step(e), exit_on_fatal)
    info = server_info(engine, dict(host_info or {}, kv_agent=agent.name, kv_incarnation=agent.incarnation))
    server = PrefillServer(engine, loop, hooks, agent, PeerDirectory(tconfig.metadata_timeout, config.internal_headers),
                          metrics)
    state = WorkerState(loop, registry, info, extra_load=lambda: {
        "num_prefill_bootstrap_queue_reqs": server.bootstrapping,
        "num_prefill_inflight_queue_reqs": sender.num_inflight})
    connect = connect_route(agent, server.directory, lambda fn: loop.call(lambda e: fn()), DEFAULT_DEADLINE_S)
    app = create_worker_app(state, [(PATH, server.prefill, ["POST"]), (ABORT_PATH, server.abort, ["POST"]),
                                    (CONNECT_PATH, connect, ["POST"])], on_shutdown=agent.close)
    app.include_router(make_router(agent.info))
    return app
