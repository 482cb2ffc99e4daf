"""Decode side of the handover, in the engine thread: the table of `RemoteRequest`s and the receiver's driver.

`DecodeHooks` keeps one `RemoteRequest` per remote request until the record is
RUNNING or RELEASED, and turns the engine's reservations and the receiver's
events into the record's transitions; every decision about pages is the
record's (``decode/request.py``). Handlers reach the table only through
engine-thread commands (`EngineLoop.call` / `call_soon`) and `get`.

A reservation names how many leading prompt pages the engine's prefix cache
held (the ticket starts after them: a delta transfer); a request the engine
admitted to prefill here (``--max-local-prefill-length``) goes straight to
RUNNING, logged at INFO and counted.
"""

from __future__ import annotations

import logging


from pd_cluster.decode.metrics import DecodeReuseMetrics
from pd_cluster.decode.request import RemoteRequest, RemoteState
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import StepOutput
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import StepHooks
from pd_cluster.transfer.interfaces import Receiver

logger = logging.getLogger("pd.decode")


def skip_first_token_draw(engine: LLMEngine, req: Request) -> None:
    """Advance `req`'s generator exactly as sampling its first token did on the prefill worker.

    The prefill worker sampled the first token from the same per-request seed, so this worker's generator
    must be one draw further, as a mixed worker's would be, for seeded sampling to give the same tokens in
    PD and mixed mode. The sampler owns what one draw is (`Sampler.skip`).
    """
    engine.runner.sampler.skip(req.params, req.generator)


class DecodeHooks(StepHooks):
    """Drives the receiver from the engine thread and owns the decode worker's `RemoteRequest`s.

    Args:
        receiver: the worker's receiver (`KVReceiver`, or `TPReceiver` under tensor parallelism).
        metrics: the reuse counters (None: not counted).
    """

    def __init__(self, receiver: Receiver, metrics: DecodeReuseMetrics | None = None) -> None:
        self.receiver = receiver
        self.metrics = metrics
        self._records: dict[str, RemoteRequest] = {}
        self._by_transfer: dict[str, RemoteRequest] = {}  # an index of `_records` by ticket

    # ---- read from any thread -------------------------------------------------------------------------
    def get(self, request_id: str) -> RemoteRequest | None:
        """The request's record while it is neither RUNNING nor RELEASED."""
        return self._records.get(request_id)

    @property
    def num_prealloc(self) -> int:
        """Requests registered but without pages yet (SGLang's decode prealloc queue)."""
        return sum(1 for r in list(self._records.values()) if r.state is RemoteState.QUEUED)

    def has_pending(self) -> bool:
        return bool(self._by_transfer) or self.receiver.has_work

    # ---- commands (engine thread) ---------------------------------------------------------------------
    def register(self, engine: LLMEngine, rec: RemoteRequest, prompt_ids: list[int], params: SamplingParams,
                 stream: bool, resumed: list[int] | None = None) -> None:
        """Queue a remote request in the engine (QUEUED). Raises as `LLMEngine.add_remote_request`."""
        if rec.request_id in self._records:
            raise ValueError(f"request {rec.request_id} is already registered")
        engine.add_remote_request(rec.request_id, prompt_ids, params, stream=stream, resumed_output_ids=resumed or ())
        self._records[rec.request_id] = rec

    def send(self, engine: LLMEngine, request_id: str) -> None:
        """The handler is about to send the ticket to the prefill worker (RESERVED -> ARRIVING)."""
        rec = self._records.get(request_id)
        if rec is not None:
            rec.send()

    def fail(self, engine: LLMEngine, request_id: str, error: BaseException, *, refused: bool = False,
             peer_gone: bool = False) -> None:
        """The request failed on the handler's side (see `RemoteRequest.fail`)."""
        rec = self._records.get(request_id)
        if rec is not None:
            rec.fail(engine, self.receiver, error, refused=refused, peer_gone=peer_gone)
            self._settle_table(rec)

    def abort(self, engine: LLMEngine, request_id: str, reason: str) -> None:
        """The client went away (or the handler gave up): stop the request wherever it is."""
        rec = self._records.get(request_id)
        if rec is None:  # running (the engine owns it) or never registered
            engine.abort_request(request_id)
            return
        self.fail(engine, request_id, RequestAborted(reason))

    # ---- the step loop --------------------------------------------------------------------------------
    def after_step(self, engine: LLMEngine, out: StepOutput) -> None:
        for request_id, pages, num_cached_pages, group_tables in out.reserved:
            rec = self._records.get(request_id)
            if rec is None:
                continue
            rec.reserve(engine, self.receiver, pages, num_cached_pages, group_tables)
            if rec.transfer_id is not None:
                self._by_transfer[rec.transfer_id] = rec
            self._settle_table(rec)
        for request_id in out.local_prefills:
            rec = self._records.get(request_id)
            if rec is None:
                continue
            req = engine.requests[request_id]
            cached = req.num_cached_tokens or 0
            logger.info("request %s: prefilling %d of %d prompt tokens locally (%d in this worker's prefix cache; "
                        "--max-local-prefill-length %d); no prefill worker", request_id,
                        req.num_prompt_tokens - cached, req.num_prompt_tokens, cached,
                        engine.config.scheduler.max_local_prefill_length)
            rec.run_locally()
            self._count_saved(engine, cached // engine.layout.page_size, cached)  # what the local prefill reads
            if self.metrics is not None:
                self.metrics.local_prefills.inc()
            self._settle_table(rec)

    def _count_saved(self, engine: LLMEngine, num_cached_pages: int, position: int) -> None:
        """Count the prompt pages this worker's prefix cache held that a query at `position` reads, one page per
        KV group (a windowed group's pages behind that window are not a saving: nobody needed them)."""
        if self.metrics is None or not num_cached_pages:
            return
        firsts = (engine.kv_groups.decode_first_pages(position, engine.layout.page_size)
                  if not engine.kv_groups.is_single else (0,))
        pages = sum(max(num_cached_pages - f, 0) for f in firsts)
        # every TP rank holds its share of the heads in a page of `page_nbytes`
        self.metrics.saved_bytes.inc(pages * engine.layout.page_nbytes * engine.config.parallel.tp_size)

    def _count_window_skipped(self, engine: LLMEngine, rec: RemoteRequest) -> None:
        """Count the pages of windowed KV groups behind the window of the first decode query: not transferred,
        never read here (whether or not the cache held them)."""
        if self.metrics is None or not rec.ticket.group_first_pages:
            return
        skipped = sum(engine.kv_groups.decode_first_pages(rec.ticket.num_tokens, engine.layout.page_size))
        if skipped:
            self.metrics.window_skipped_bytes.inc(skipped * engine.layout.page_nbytes * engine.config.parallel.tp_size)

    def poll(self, engine: LLMEngine) -> None:
        if not self._by_transfer and not self.receiver.has_work:
            return
        ev = self.receiver.poll()
        self.transfer_events += len(ev.completed) + len(ev.failed) + len(ev.released)
        for done in ev.completed:
            rec = self._by_transfer.get(done.transfer_id)
            if rec is None:
                continue
            first = done.meta.get("first_token_id")
            lp = done.meta.get("first_logprob")
            logprob = (lp[0], [(int(i), float(v)) for i, v in lp[1]]) if lp else None
            cached = _cached_tokens(done.meta.get("num_cached_tokens"))
            prompt_lps = _prompt_logprobs(done.meta.get("prompt_logprobs"))
            req = engine.requests.get(rec.request_id)
            if rec.complete(engine, done, None if first is None else int(first), logprob,
                            num_cached_tokens=cached, prompt_logprobs=prompt_lps) and req is not None:
                skip_first_token_draw(engine, req)
                self._count_saved(engine, rec.num_cached_pages, rec.ticket.num_tokens)
                self._count_window_skipped(engine, rec)
            self._settle_table(rec)
        for failed in ev.failed:
            rec = self._by_transfer.get(failed.transfer_id)
            if rec is not None:
                rec.on_transfer_failed(engine, failed.error)
                self._settle_table(rec)
        for rel in ev.released:
            rec = self._by_transfer.get(rel.transfer_id)
            if rec is not None:
                rec.on_pages_released(engine, rel)
                self._settle_table(rec)

    def _settle_table(self, rec: RemoteRequest) -> None:
        """Drop a record that no longer needs the engine thread (RUNNING or RELEASED)."""
        if rec.state.over:
            self._records.pop(rec.request_id, None)
            if rec.transfer_id is not None:
                self._by_transfer.pop(rec.transfer_id, None)


class RequestAborted(Exception):
    """The request was aborted on decode (the client went away)."""


def _prompt_logprobs(value) -> list | None:
    """The prompt logprobs a push notification carried (`PromptLogprob` tuples), or None when absent or
    malformed (the HTTP handler then answers that they are unavailable)."""
    if not isinstance(value, list):
        return None
    try:
        return [(float(c), [(int(i), float(v)) for i, v in top], int(rank)) for c, top, rank in value]
    except (TypeError, ValueError):
        logger.warning("a KV push notification carried malformed prompt logprobs: ignored")
        return None


def _cached_tokens(value) -> int:
    """The prefill worker's cached prompt tokens from a push notification (0 when absent or malformed)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return 0
