"""Prefill jobs in the engine thread: chunked prefill with a push after every chunk.

A job is one request sent by a decode worker with its `KVTicket` (the decode
pages reserved for the prompt). After each engine step, the pages that step
completed are pushed (`KVSender.push`); the push that reaches the end of the
prompt carries the first token, and the prompt tokens this worker's prefix
cache served (``num_cached_tokens``), in its notification; a request that asked for prompt logprobs
(vLLM's ``prompt_logprobs``, ``echo`` with ``logprobs``) gets them there too: they need this worker's logits
at every prompt position, which no other worker computes. The job ends when the
sender reports every push complete (the prefill pages are freed) or failed
(freed once no NIXL handle is left). An aborted job (decode went away, by
HTTP, ``/abort`` or a NIXL cancel) logs one INFO line, whichever came first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import StepOutput
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import StepHooks, settle_future
from pd_cluster.transfer.errors import TransferAbortedError, TransferError
from pd_cluster.transfer.interfaces import Sender
from pd_cluster.transfer.ticket import Ticket

logger = logging.getLogger("pd.prefill")

FAULT_CHUNK_DELAY_ENV = "PD_FAULT_PREFILL_CHUNK_DELAY"


@dataclass(frozen=True)
class ChunkDelay:
    """Fault injection, for tests only: make prefill chunks compute longer.

    Set ``PD_FAULT_PREFILL_CHUNK_DELAY=<seconds>[:<marker>]`` in a prefill worker's environment: after every
    engine step that computed prompt tokens of a job whose request id contains ``marker`` (every job when no
    marker is given), the engine thread sleeps ``seconds`` before that step's pushes, exactly as if the
    chunk's forward pass had taken that much longer (the step loop polls nothing meanwhile; other threads
    run). No flag exposes it: it exists to test that a long chunk does not fail a KV transfer.

    Attributes:
        seconds: the added compute time per step, in seconds (> 0).
        marker: a substring of the request ids it applies to ("" : all).
    """

    seconds: float
    marker: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ChunkDelay | None":
        """The delay set in `environ`, or None.

        Raises:
            ValueError: a malformed value (named with the variable).
        """
        raw = environ.get(FAULT_CHUNK_DELAY_ENV)
        if not raw:
            return None
        seconds, _, marker = raw.partition(":")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ValueError(f"{FAULT_CHUNK_DELAY_ENV}={raw!r}: expected <seconds>[:<request-id marker>], seconds > 0")
        logger.warning("fault injection: prefill chunks of requests matching %r compute %.2f s longer (%s)",
                       marker, value, FAULT_CHUNK_DELAY_ENV)
        return cls(value, marker)

    def applies(self, request_ids) -> bool:
        return any(self.marker in rid for rid in request_ids)


@dataclass
class JobResult:
    """What the job produced: the first token (sent in the last push), and where the time went (seconds)."""

    first_token_id: int | None = None
    first_logprob: list | None = None
    queue_s: float = 0.0
    prefill_s: float = 0.0
    push_tail_s: float = 0.0
    num_pushes: int = 0
    nbytes: int = 0
    num_cached_tokens: int = 0
    error: TransferError | None = None


@dataclass
class PrefillJob:
    """One request being prefilled here for a decode worker."""

    request_id: str
    ticket: Ticket
    future: asyncio.Future
    aloop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)
    abort_logged: bool = False
    first_scheduled: float | None = None
    last_chunk: float | None = None
    result: JobResult = field(default_factory=JobResult)

    def resolve(self) -> None:
        self.aloop.call_soon_threadsafe(settle_future, self.future, self.result)


class PrefillHooks(StepHooks):
    """Drives the `KVSender` from the engine thread.

    Args:
        sender: the worker's sender.
        device: the engine's device (a CUDA event gates each push on GPU).
        chunk_delay: fault injection for tests (`ChunkDelay`); None in production.
    """

    def __init__(self, sender: Sender, device: torch.device, chunk_delay: ChunkDelay | None = None) -> None:
        self.sender = sender
        self.device = device
        self.chunk_delay = chunk_delay
        self.jobs: dict[str, PrefillJob] = {}

    def start(self, engine: LLMEngine, job: PrefillJob, prompt_ids: list[int], params: SamplingParams,
              resumed_output_ids: list[int] | None = None) -> None:
        """Queue the job's prefill and register its transfer (engine thread).

        `resumed_output_ids`: a migrated stream's output so far; its KV is computed and pushed with the prompt's.

        Raises:
            RequestRejected, EngineOverloaded: from the engine.
            TransferError, ValueError: from the sender (stale ticket, bad pages); the request is withdrawn.
        """
        engine.add_request(job.request_id, prompt_ids, params, resumed_output_ids=resumed_output_ids or ())
        try:
            self.sender.add_request(job.ticket)
        except BaseException:
            engine.abort_request(job.request_id)
            raise
        self.jobs[job.request_id] = job

    def abort(self, engine: LLMEngine, request_id: str, reason: str) -> None:
        """Stop a job (decode went away): no more chunks; the pages are freed when the sender has stopped."""
        job = self.jobs.get(request_id)
        if job is None:
            return
        self._log_abort(job, reason)
        engine.abort_request(request_id, release_pages=False)
        self.sender.abort(job.ticket.transfer_id, reason)

    @staticmethod
    def _log_abort(job: PrefillJob, reason: str) -> None:
        if not job.abort_logged:
            job.abort_logged = True
            logger.info("prefill %s: aborted (%s)", job.request_id, reason)

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None:
        for d in out.deltas:  # the engine failed this job's request alone: stop its pushes, free via `poll`
            if d.finish_reason == "error" and d.request_id in self.jobs:
                job = self.jobs[d.request_id]
                logger.warning("prefill %s: failed in the engine: %s", job.request_id, d.error)
                self.sender.abort(job.ticket.transfer_id, f"the prefill engine failed the request: {d.error}")
        if not out.prefill_progress:
            return
        if self.chunk_delay is not None and self.chunk_delay.applies(
                p.request_id for p in out.prefill_progress if p.request_id in self.jobs):
            time.sleep(self.chunk_delay.seconds)  # fault injection: this chunk computed longer
        firsts = {d.request_id: d for d in out.deltas if d.request_id in self.jobs and d.new_token_ids}
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        now = time.monotonic()
        for prog in out.prefill_progress:
            job = self.jobs.get(prog.request_id)
            if job is None:
                continue
            req = engine.requests.get(prog.request_id)
            job.first_scheduled = job.first_scheduled or (req.times.first_scheduled if req else now)
            meta = None
            if prog.done:
                job.last_chunk = now
                d = firsts[prog.request_id]
                job.result.first_token_id = d.new_token_ids[0]
                job.result.first_logprob = _jsonable(d.new_logprobs[0]) if d.new_logprobs else None
                job.result.num_cached_tokens = int(req.num_cached_tokens or 0) if req is not None else 0
                meta = {"first_token_id": job.result.first_token_id, "first_logprob": job.result.first_logprob,
                        "num_cached_tokens": job.result.num_cached_tokens}
                if d.prompt_logprobs is not None:  # computed here, for every prompt position
                    meta["prompt_logprobs"] = [_jsonable_prompt(lp) for lp in d.prompt_logprobs]
            group_tables = prog.group_tables
            if engine.kv_groups.state_group is not None:  # its pages go with the prompt's last one
                group_tables = engine.kv_groups.transfer_tables([prog.block_table, *group_tables],
                                                                job.ticket.num_tokens, engine.layout.page_size)[1:]
            self.sender.push(job.ticket.transfer_id, prog.block_table, prog.end, meta=meta, ready_event=ready,
                             group_tables=group_tables)

    def poll(self, engine: LLMEngine) -> None:
        if not self.jobs and not self.sender.has_work:  # poll also moves the last acknowledgement out
            return
        ev = self.sender.poll()
        self.transfer_events += len(ev.completed) + len(ev.failed)
        now = time.monotonic()
        for done in ev.completed:
            job = self.jobs.pop(done.request_id, None)
            if job is None:
                continue
            engine.release_request(job.request_id)
            r = job.result
            r.num_pushes, r.nbytes = done.num_pushes, done.nbytes
            self._timings(job, now)
            job.resolve()
        for failed in ev.failed:
            job = self.jobs.pop(failed.request_id, None)
            if job is None:
                continue
            if isinstance(failed.error, TransferAbortedError):
                self._log_abort(job, str(failed.error))
            if not engine.abort_request(job.request_id, release_pages=True):
                engine.release_request(job.request_id)
            job.result.error = failed.error
            self._timings(job, now)
            job.resolve()

    @staticmethod
    def _timings(job: PrefillJob, now: float) -> None:
        r = job.result
        start = job.first_scheduled or now
        r.queue_s = max(start - job.arrival, 0.0)
        r.prefill_s = max((job.last_chunk or now) - start, 0.0)
        r.push_tail_s = max(now - (job.last_chunk or now), 0.0)

    def has_pending(self) -> bool:
        return bool(self.jobs) or self.sender.has_work


def _jsonable_prompt(logprob) -> list:
    chosen, top, rank = logprob
    return [float(chosen), [[int(i), float(v)] for i, v in top], int(rank)]


def _jsonable(logprob) -> list:
    chosen, top = logprob
    return [chosen, [[int(i), float(v)] for i, v in top]]
