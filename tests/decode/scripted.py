"""Scripted stand-ins for the decode worker's tests: a receiver driven by the test, and a real prefill.

`ScriptedReceiver` implements `pd_cluster.transfer.interfaces.Receiver` without NIXL: the test decides
what each `poll` reports. `LocalPrefill` computes a prompt's KV with a real prefill-role engine on the
embedded model and copies its pages into the decode pool, as the NIXL WRITEs would.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pd_cluster.common.openai_errors import openai_error_type
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.transfer.errors import PeerNotConnectedError, TransferError
from pd_cluster.transfer.receiver_events import PagesReleased, ReceiverEvents, RecvDone, RecvFailed
from pd_cluster.transfer.ticket import KVTicket

PREFILL_AGENT = "prefill-test-1-tp0-aaaa"
DECODE_AGENT = "decode-test-1-tp0-bbbb"
ENGINE_ARGS = dict(page_size=16, num_pages=40)


def decode_engine(**kw) -> LLMEngine:
    return LLMEngine(config_from_kwargs(role="decode", **{**ENGINE_ARGS, **kw}))


class ScriptedReceiver:
    """A `Receiver` whose events the test scripts; it records every call."""

    def __init__(self, page_size: int, peers: tuple[str, ...] = (PREFILL_AGENT,)) -> None:
        self.page_size = page_size
        self.peers = peers
        self.tickets: dict[str, KVTicket] = {}
        self.calls: list[tuple] = []
        self.pending = ReceiverEvents()
        self.pushed: set[str] = set()       # transfers a push of which "arrived" (withdraw refuses them)
        self.refuse_expect: Exception | None = None
        self._seq = 0

    @property
    def has_work(self) -> bool:
        return bool(self.tickets) or bool(self.pending.completed or self.pending.failed or self.pending.released)

    @property
    def num_waiting(self) -> int:
        return len(self.tickets)

    def expect(self, request_id, pages, num_tokens, prefill_agent, first_page=0, group_first_pages=()) -> KVTicket:
        self.calls.append(("expect", request_id))
        if self.refuse_expect is not None:
            raise self.refuse_expect
        if prefill_agent not in self.peers:
            raise PeerNotConnectedError(f"no metadata loaded for peer agent {prefill_agent}", peer=prefill_agent)
        self._seq += 1
        t = KVTicket(f"{request_id}@x.{self._seq}", request_id, DECODE_AGENT, prefill_agent,
                     tuple(int(p) for p in pages), num_tokens, self.page_size, first_page, tuple(group_first_pages))
        self.tickets[t.transfer_id] = t
        return t

    def abort(self, transfer_id, message="aborted by decode") -> bool:
        self.calls.append(("abort", transfer_id))
        return transfer_id in self.tickets

    def withdraw(self, transfer_id) -> tuple[int, ...]:
        self.calls.append(("withdraw", transfer_id))
        if transfer_id in self.pushed:
            raise ValueError(f"transfer {transfer_id} already received pushes; abort it instead")
        t = self.tickets.pop(transfer_id, None)
        return () if t is None else t.dst_pages

    def peer_failed(self, prefill_agent, message) -> None:
        self.calls.append(("peer_failed", prefill_agent))

    def poll(self) -> ReceiverEvents:
        ev, self.pending = self.pending, ReceiverEvents()
        return ev

    # ---- scripting -------------------------------------------------------------
    def ticket_of(self, request_id: str) -> KVTicket:
        return next(t for t in self.tickets.values() if t.request_id == request_id)

    def complete(self, request_id: str, first_token: int | None) -> None:
        t = self.tickets.pop(self.ticket_of(request_id).transfer_id)
        meta = {} if first_token is None else {"first_token_id": first_token, "first_logprob": None}
        self.pending.completed.append(RecvDone(t.transfer_id, request_id, t.dst_pages, meta, (), 0, 0.01, 0.0))

    def fail(self, request_id: str, error: TransferError) -> None:
        t = self.ticket_of(request_id)
        self.pending.failed.append(RecvFailed(t.transfer_id, request_id, error))

    def release(self, request_id: str, why: str = "sender stopped") -> None:
        t = self.tickets.pop(self.ticket_of(request_id).transfer_id)
        self.pending.released.append(PagesReleased(t.transfer_id, request_id, t.dst_pages, why))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


class LocalPrefill:
    """A real prefill-role engine whose pages are copied into a decode engine's pool (the WRITEs, in-process)."""

    def __init__(self) -> None:
        self.engine = LLMEngine(config_from_kwargs(role="prefill", **ENGINE_ARGS))
        self._n = 0

    def prefill_into(self, decode: LLMEngine, pages: tuple[int, ...], prompt_ids: list[int],
                     params: SamplingParams) -> int:
        """Prefill `prompt_ids`, copy their KV into `decode`'s `pages`; returns the first token."""
        self._n += 1
        rid = f"p{self._n}"
        e = self.engine
        e.add_request(rid, prompt_ids, params)
        first = None
        while first is None:
            for d in e.step().deltas:
                if d.request_id == rid and d.new_token_ids:
                    first = d.new_token_ids[0]
        src = list(e.scheduler.held[rid].block_table)
        assert len(src) == len(pages)
        decode.pool.kv[list(pages)] = e.pool.kv[src]
        e.release_request(rid)
        return first


def run_loop(aloop: asyncio.AbstractEventLoop) -> None:
    """Let the event loop run the callbacks the engine thread scheduled (`call_soon_threadsafe`)."""
    aloop.run_until_complete(asyncio.sleep(0))


class FakePrefill:
    """A prefill worker's HTTP side: ``/prefill`` answers as `mode` says; ``/abort`` is recorded."""

    def __init__(self) -> None:
        self.mode = "400"
        self.jobs: list[dict] = []
        self.aborts: list[str] = []
        app = FastAPI()

        @app.post("/prefill")
        async def prefill(request: Request):
            self.jobs.append(await request.json())
            if self.mode == "400":
                return JSONResponse({"error": {"message": "prompt: too long", "type": openai_error_type(400),
                                               "param": "prompt", "code": "invalid_value"}}, status_code=400)
            if self.mode == "hang":
                await asyncio.sleep(30)
            return JSONResponse({"error": {"message": "boom", "code": "internal_error"}}, status_code=500)

        @app.post("/abort")
        async def abort(request: Request):
            self.aborts.append((await request.json())["request_id"])
            return {"aborted": True}

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True  # a "hang" answer is still sleeping: do not wait for it
        self.thread.join(10)
