"""The decode worker's HTTP server: the OpenAI API, with prompts prefilled remotely and KV received over NIXL."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from pd_cluster.decode.handover import DecodeHooks
from pd_cluster.decode.metrics import DecodeReuseMetrics
from pd_cluster.decode.remote_prefill import RemotePrefill
from pd_cluster.disagg.peers import PeerLinks
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.openai_serving import serving_routes
from pd_cluster.serving.openai_serving import OpenAIServing
from pd_cluster.serving.worker_app import WorkerConfig, WorkerState, create_worker_app, server_info, worker_engine_loop
from pd_cluster.transfer.http import PeerDirectory, make_router
from pd_cluster.transfer.factory import make_worker_transfer


def build_decode_app(engine: LLMEngine, config: WorkerConfig, host_info: dict[str, Any] | None = None,
                     exit_on_fatal: bool = True) -> FastAPI:
    """A FastAPI app for `engine` in the decode role, with its transfer agent
    (`pd_cluster.serving.worker_app.WorkerAppBuilder`: the signature of every role's app)."""
    host_info = dict(host_info or {})
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "decode", engine.model_name)
    tconfig = config.transfer
    agent, receiver = make_worker_transfer(engine, "decode", tconfig, registry)
    hooks = DecodeHooks(receiver, DecodeReuseMetrics(registry))

    def on_step(e, out, dt):
        metrics.on_step(e)

    # counted when scraped, not at every step: a walk over every remote request, which can be thousands
    metrics.num_decode_prealloc_queue_reqs.set_function(lambda: hooks.num_prealloc)

    loop = worker_engine_loop(engine, hooks, on_step, exit_on_fatal)
    source = RemotePrefill(loop, hooks, agent, PeerDirectory(tconfig.metadata_timeout, config.internal_headers),
                           host_info.get("url", ""), config.prefill_url, internal_api_key=config.internal_api_key,
                           prefill_urls=config.prefill_urls)
    info = server_info(engine, dict(host_info, kv_agent=agent.name, kv_incarnation=agent.incarnation))
    state = WorkerState(loop, registry, info, extra_load=lambda: {
        "num_decode_prealloc_queue_reqs": hooks.num_prealloc,
        "num_decode_transfer_queue_reqs": receiver.num_waiting})
    serving = OpenAIServing(source, engine.tokenizer, engine.model_name, engine.context_length, metrics, config.tools,
                            engine.generation, page_size=engine.layout.page_size)
    # readiness: meet the known prefill workers (both handshakes) before /health turns 200 (disagg/peers.py)
    links = PeerLinks(agent, source.directory, lambda fn: loop.call(lambda e: fn()), host_info.get("url", ""),
                      (*config.prefill_urls, *((config.prefill_url,) if config.prefill_url else ())), source.client)

    def startup() -> None:
        if links.peers and links.self_url:
            state.starting = "connecting to the KV transfer peers"
            links.start(on_ready=lambda: setattr(state, "starting", None))

    async def shutdown() -> None:
        await links.close()
        await source.close()
        agent.close()

    app = create_worker_app(state, serving_routes(serving), on_startup=startup, on_shutdown=shutdown)
    app.include_router(make_router(agent.info))
    return app
