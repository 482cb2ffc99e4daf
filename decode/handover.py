"""Decode side of the handover, in the engine thread: reserve pages, make the ticket, complete or fail.

Each remote request goes through: registered (waiting for pages in the
engine's prealloc queue) -> ticket made when the scheduler reserved its pages
-> completed when `KVReceiver.poll` reports every push arrived (the request
joins the running batch with the first token from the last push) or failed
(the request is aborted; its pages stay held until the receiver says the
sender has stopped writing into them).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import StepOutput
from pd_cluster.serving.engine_loop import StepHooks, settle_future
from pd_cluster.transfer.errors import TransferError
from pd_cluster.transfer.receiver import KVReceiver

logger = logging.getLogger("pd.decode")


@dataclass
class Handover:
    """The futures a request handler awaits, resolved from the engine thread."""

    request_id: str
    prefill_agent: str
    ticket_future: asyncio.Future
    kv_future: asyncio.Future
    aloop: asyncio.AbstractEventLoop
    transfer_id: str | None = None

    def resolve(self, fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        self.aloop.call_soon_threadsafe(settle_future, fut, result, error)


class DecodeHooks(StepHooks):
    """Drives the `KVReceiver` from the engine thread.

    Args:
        receiver: the worker's receiver.
    """

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.by_request: dict[str, Handover] = {}
        self.by_transfer: dict[str, Handover] = {}

    @property
    def num_prealloc(self) -> int:
        """Requests registered but without pages yet (SGLang's decode prealloc queue)."""
        return sum(1 for h in self.by_request.values() if h.transfer_id is None)

    def register(self, engine: LLMEngine, h: Handover, prompt_ids: list[int], params, stream: bool) -> None:
        """Queue a remote request in the engine (engine thread). Raises as `LLMEngine.add_remote_request`."""
        engine.add_remote_request(h.request_id, prompt_ids, params, stream=stream)
        self.by_request[h.request_id] = h

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None:
        for request_id, pages in out.reserved:
            h = self.by_request.get(request_id)
            if h is None:
                continue
            req = engine.requests[request_id]
            try:
                ticket = self.receiver.expect(request_id, pages, req.num_prompt_tokens, h.prefill_agent)
            except (TransferError, ValueError) as e:
                self._drop(engine, h)
                engine.abort_request(request_id)
                h.resolve(h.ticket_future, error=e)
                continue
            h.transfer_id = ticket.transfer_id
            self.by_transfer[ticket.transfer_id] = h
            h.resolve(h.ticket_future, ticket)

    def poll(self, engine: LLMEngine) -> None:
        if not self.by_transfer and not self.receiver.has_work:
            return
        ev = self.receiver.poll()
        for done in ev.completed:
            h = self.by_transfer.get(done.transfer_id)
            if h is None:
                continue
            self._drop(engine, h)
            req = engine.requests.get(h.request_id)
            if req is not None:
                req.times.kv_wait_s = done.wait_s
            first = done.meta.get("first_token_id")
            lp = done.meta.get("first_logprob")
            logprob = (lp[0], [(int(i), float(v)) for i, v in lp[1]]) if lp else None
            ok = first is not None and engine.complete_remote_prefill(h.request_id, int(first), logprob)
            if ok and req is not None and req.generator is not None and not req.params.greedy:
                # prefill drew the first token from the same seed: keep the generator in step with mixed mode
                torch.empty(engine.arch.vocab_size, device=engine.device).exponential_(generator=req.generator)
            err = None if ok else RuntimeError(f"request {h.request_id} was no longer waiting for its KV")
            h.resolve(h.kv_future, done, err)
        for failed in ev.failed:
            h = self.by_transfer.get(failed.transfer_id)
            if h is None:
                continue
            self._drop(engine, h)
            engine.abort_request(h.request_id, release_pages=False)
            h.resolve(h.kv_future, error=failed.error)
        for rel in ev.released:
            engine.release_request(rel.request_id)

    def fail(self, engine: LLMEngine, request_id: str, message: str, peer_gone: bool) -> None:
        """The prefill call failed: fail the transfer (its pages come back once the sender is known stopped)."""
        h = self.by_request.get(request_id)
        if h is None or h.transfer_id is None:
            return
        if peer_gone:
            self.receiver.peer_failed(h.prefill_agent, message)
        else:
            self.receiver.abort(h.transfer_id, message)

    def withdraw(self, engine: LLMEngine, request_id: str) -> None:
        """Prefill refused the ticket before writing anything: free the pages at once."""
        h = self.by_request.get(request_id)
        if h is None or h.transfer_id is None:
            return
        try:
            self.receiver.withdraw(h.transfer_id)
        except ValueError:  # a push did arrive: the sender may still write; go through the abort path
            self.receiver.abort(h.transfer_id, "prefill refused the transfer after pushing")
            return
        self._drop(engine, h)
        engine.abort_request(request_id, release_pages=True)

    def abort(self, engine: LLMEngine, request_id: str, reason: str) -> None:
        """The client went away (or the handler gave up): stop the request wherever it is."""
        h = self.by_request.get(request_id)
        if h is not None and h.transfer_id is not None:
            self.receiver.abort(h.transfer_id, reason)  # failure, then pages, come back through poll
            return
        if h is not None:
            self._drop(engine, h)
        engine.abort_request(request_id)

    def _drop(self, engine: LLMEngine, h: Handover) -> None:
        self.by_request.pop(h.request_id, None)
        if h.transfer_id is not None:
            self.by_transfer.pop(h.transfer_id, None)

    def has_pending(self) -> bool:
        return bool(self.by_transfer) or self.receiver.has_work
