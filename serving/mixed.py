"""The mixed worker: the OpenAI API over a local engine that prefills and decodes (no transfer)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.serving.metrics import WorkerMetrics
from pd_cluster.serving.openai_serving import OpenAIServing, PromptSource, serving_routes
from pd_cluster.serving.worker_app import WorkerConfig, WorkerState, create_worker_app, server_info, worker_engine_loop


class LocalPrefill(PromptSource):
    """Prefill in the same engine (the mixed role)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    headers: dict[str, str], resumed: list[int] | None = None) -> asyncio.Queue:
        stream = self.loop.open_stream(request_id)
        try:
            await self.loop.call(lambda e: e.add_request(request_id, prompt_ids, params, stream=True,
                                                         resumed_output_ids=resumed or ()))
        except BaseException:
            self.loop.close_stream(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self.loop.close_stream(request_id)
        self.loop.call_soon(lambda e: e.abort_request(request_id))


def build_mixed_app(engine: LLMEngine, config: WorkerConfig, host_info: dict[str, Any] | None = None,
                    exit_on_fatal: bool = True) -> FastAPI:
    """A FastAPI app serving `engine` (role mixed) with the OpenAI API and the common endpoints
    (`pd_cluster.serving.worker_app.WorkerAppBuilder`: the signature of every role's app)."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, engine.role, engine.model_name)
    loop = worker_engine_loop(engine, on_step=lambda e, out, dt: metrics.on_step(e), exit_on_fatal=exit_on_fatal)
    state = WorkerState(loop, registry, server_info(engine, host_info))
    serving = OpenAIServing(LocalPrefill(loop), engine.tokenizer, engine.model_name, engine.context_length, metrics,
                            config.tools, engine.generation, page_size=engine.layout.page_size)
    return create_worker_app(state, serving_routes(serving), on_shutdown=serving.tok.close)
