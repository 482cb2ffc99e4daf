"""The fake worker's endpoints beside the OpenAI API: ``/health``, ``/v1/models``, ``/get_load``,
``/server_info`` and ``/metrics`` of the worker contract (``docs/worker-api.md``), and ``/debug/requests`` and
``/debug/timers`` (how late its own delays fired).

`FakeEndpoints` is a mixin of `FakeServer` (``bench/fake_server.py``), which owns the counters they report.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pd_cluster.bench.fake_format import JSON
from pd_cluster.bench.httpserver import Request, Responder


class FakeEndpoints:
    """`FakeServer`'s probe, info, metrics and debug routes."""

    async def _probe_delay(self) -> None:
        if self.capacity is not None and self.capacity.full and self.config.probe_delay_at_capacity_ms:
            await asyncio.sleep(self.config.probe_delay_at_capacity_ms / 1000.0)

    async def _health(self, req: Request, resp: Responder) -> None:
        await self._probe_delay()
        resp.send(200, b'{"status": "ok"}', [JSON])

    async def _models(self, req: Request, resp: Responder) -> None:
        c = self.config
        card = {"id": c.model, "object": "model", "created": 0, "owned_by": "pd-cluster",
                "root": c.model, "max_model_len": c.context_length}
        resp.send(200, json.dumps({"object": "list", "data": [card]}).encode(), [JSON])

    async def _get_load(self, req: Request, resp: Responder) -> None:
        await self._probe_delay()
        resp.send(200, json.dumps(self.load()).encode(), [JSON])

    def load(self) -> dict[str, Any]:
        """The ``/get_load`` body of the contract."""
        c = self.config
        queued = self._queued + (self.capacity.queued if self.capacity is not None else 0)
        return {"role": c.role, "num_running_reqs": self._running, "num_queue_reqs": queued,
                "token_usage": self.token_usage(), "num_free_pages": self._total_pages - self._used_pages,
                "num_total_pages": self._total_pages, "max_running_requests": c.max_running_requests,
                "num_prefill_bootstrap_queue_reqs": 0, "num_prefill_inflight_queue_reqs": 0,
                "num_decode_prealloc_queue_reqs": 0, "num_decode_transfer_queue_reqs": self._transferring}

    async def _server_info(self, req: Request, resp: Responder) -> None:
        c = self.config
        info = {"role": c.role, "model": c.model, "served_model_name": c.model, "page_size": c.page_size,
                "kv_cache_dtype": "fp8_e4m3", "max_total_num_tokens": c.max_total_num_tokens,
                "context_length": c.context_length, "max_running_requests": c.max_running_requests,
                "layout_hash": "fake-" + c.model, "incarnation": self.incarnation}
        resp.send(200, json.dumps(info).encode(), [JSON])

    async def _metrics(self, req: Request, resp: Responder) -> None:
        body = self.metrics.render(self._generated_total)
        resp.send(200, body, [("content-type", "text/plain; version=0.0.4; charset=utf-8")])

    async def _debug_requests(self, req: Request, resp: Responder) -> None:
        resp.send(200, json.dumps(list(self.recent)).encode(), [JSON])

    async def _debug_timers(self, req: Request, resp: Responder) -> None:
        resp.send(200, json.dumps(self.timer_stats()).encode(), [JSON])

    def timer_stats(self) -> dict[str, float]:
        """How late the emulated delays fired (ms): ``count``, ``p50_ms``, ``p99_ms``, ``max_ms``.

        The delays are the benchmark's ground truth; a busy machine makes them late, and a test
        comparing pd-bench's numbers with the nominal delays must know by how much."""
        late = sorted(self.timer_lateness) or [0.0]
        pick = lambda q: late[min(len(late) - 1, int(q * len(late)))] * 1e3  # noqa: E731
        return {"count": len(self.timer_lateness), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": late[-1] * 1e3}
