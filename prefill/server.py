"""The prefill worker's HTTP server: ``POST /prefill`` and ``POST /abort`` for decode workers.

``POST /prefill`` (from a decode worker) carries the prompt, the sampling
parameters of the first token, the decode worker's URL and its `KVTicket`.
The handler loads the decode agent's metadata (cached per incarnation; the
layout handshake runs here and refuses mismatches by name), queues the job,
and answers once every push is complete, with the first token and the
timings. The connection stays open meanwhile: if decode goes away, the job is
aborted. Errors are OpenAI-format bodies: 400 (the engine refused the
prompt), 409 (stale peer incarnation or layout mismatch), 502 (decode's
metadata unreachable or the transfer failed), 503 (queue full), 504 (push deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.serving.errors import HTTPError, to_http_error, transfer_http_error
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.openai_serving import until_disconnect
from pd_cluster.serving.worker_app import WorkerConfig, WorkerState, create_worker_app, server_info
from pd_cluster.prefill.jobs import PrefillHooks, PrefillJob
from pd_cluster.transfer.http import PeerDirectory, apply, make_router
from pd_cluster.transfer.ticket import KVTicket
from pd_cluster.transfer.tp import make_worker_transfer, parse_ticket

logger = logging.getLogger("pd.prefill")



class PrefillServer:
    """Handlers of the prefill role."""

    def __init__(self, engine: LLMEngine, loop: EngineLoop, hooks: PrefillHooks, agent,
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
            data = json.loads(await request.body())
            rid = str(data["request_id"])
            ticket = parse_ticket(data["ticket"])
            params = SamplingParams(**data.get("sampling", {}))
            prompt_ids = [int(t) for t in data["prompt_token_ids"]]
            await self._connect(str(data["decode_url"]), ticket)
            job = PrefillJob(rid, ticket, asyncio.get_running_loop().create_future(), asyncio.get_running_loop())
            await self.loop.call(lambda e: self.hooks.start(e, job, prompt_ids, params))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            return _error(HTTPError(400, f"malformed prefill job: {e!r}", None, "invalid_job"), rid)
        except BaseException as e:  # noqa: BLE001
            return _error(transfer_http_error(e), rid)
        try:
            result = await until_disconnect(request, job.future)
        except asyncio.CancelledError:
            logger.info("prefill %s: decode went away; aborting", rid)
            self.loop.call_soon(lambda e: self.hooks.abort(e, rid, "decode closed the prefill request"))
            raise
        if result.error is not None:
            return _error(transfer_http_error(result.error), rid)
        self.metrics.queue_time.observe(result.queue_s)
        self.metrics.prefill_time.observe(result.prefill_s)
        self.metrics.request_success.labels(finish_reason="prefilled").inc()
        return JSONResponse({
            "request_id": rid, "first_token_id": result.first_token_id, "first_logprob": result.first_logprob,
            "num_pushes": result.num_pushes, "nbytes": result.nbytes,
            "timings": {"queue_s": result.queue_s, "prefill_s": result.prefill_s,
                        "push_tail_s": result.push_tail_s}})

    async def _connect(self, decode_url: str, ticket: KVTicket) -> None:
        """Load decode's agent (cached per incarnation) and run the layout handshake."""
        self.bootstrapping += 1
        self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrapping)
        try:
            resolved = await self.directory.aresolve(decode_url, expected_agent=ticket.decode_agent)
            if resolved.fetched or not self.agent.is_connected(resolved.info.agent_name):
                await self.loop.call(lambda e: apply(self.agent, resolved))
        finally:
            self.bootstrapping -= 1
            self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrapping)

    async def abort(self, request: Request) -> Response:
        try:
            rid = str(json.loads(await request.body())["request_id"])
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            return _error(HTTPError(400, f"malformed abort: {e!r}"), "?")
        self.loop.call_soon(lambda e: self.hooks.abort(e, rid, "aborted by decode"))
        return JSONResponse({"request_id": rid, "aborted": True})


def _error(err: HTTPError, rid: str) -> Response:
    if err.status >= 500 or err.status == 409:
        logger.warning("prefill %s failed: %s %s", rid, err.status, err.message)
    return JSONResponse(err.body(), status_code=err.status, headers={"X-Request-Id": rid, **err.headers})


def build_prefill_app(engine: LLMEngine, config: WorkerConfig, host_info: dict | None = None):
    """A FastAPI app for `engine` in the prefill role, with its transfer agent."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "prefill")
    tconfig = config.transfer
    agent, sender = make_worker_transfer(engine, "prefill", tconfig, registry)
    hooks = PrefillHooks(sender, engine.device)
    loop = EngineLoop(engine, hooks, on_step=lambda e, out, dt: metrics.on_step(e))
    info = server_info(engine, dict(host_info or {}, kv_agent=agent.name, kv_incarnation=agent.incarnation))
    server = PrefillServer(engine, loop, hooks, agent, PeerDirectory(tconfig.metadata_timeout), metrics)
    state = WorkerState(loop, registry, info, extra_load=lambda: {
        "num_prefill_bootstrap_queue_reqs": server.bootstrapping,
        "num_prefill_inflight_queue_reqs": sender.num_inflight})
    app = create_worker_app(state, [("/prefill", server.prefill, ["POST"]), ("/abort", server.abort, ["POST"])],
                            on_shutdown=agent.close)
    app.include_router(make_router(agent.info))
    return app
