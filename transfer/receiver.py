"""Decode side: reserve first, hand out a ticket, learn of completion without blocking.

Usage from a decode worker's step loop (single thread, nothing blocks)::

    pages = allocator.allocate(ceil(n / page_size))   # decode never asks for KV it cannot hold
    ticket = receiver.expect(request_id, pages, n, prefill_agent)
    ...send ticket.to_dict() to the prefill worker with the request...
    ...every step:
    ev = receiver.poll()
    ev.completed   -> the KV is in the pages; ev.completed[i].meta has the first token: start decoding
    ev.failed      -> answer the client with the error (502/504), the request is over
    ev.released    -> free these pages now (after a failure, once the sender has provably stopped)

Completion is declared only when every push of the transfer has arrived:
each push's notification is sent after its own WRITE completed, pushes may complete in
any order, and the last one says how many there were. The pages must also
be covered exactly once, in order.

Page safety after a failure. A WRITE already posted by the sender cannot be
stopped from here, so decode reuses the pages only when (a) the sender says
it stopped (`Stopped`, sent after it released every handle), (b) the
sender's process is gone (a liveness probe gets a disconnect), or (c) the
quarantine (``abort_quarantine``, default ``kv_transfer_timeout``) has passed
since the failure: the sender stops any push older than a quarter of the
timeout and gives up after half of it without progress or heartbeat.

The deadline counts silence: a transfer fails when neither a push nor the
sender's heartbeat (`protocol.Alive`, sent by a thread of its own while its
step loop is alive, `KVSender.heartbeat`) named it for ``kv_transfer_timeout``,
so a prefill chunk that computes longer than that does not fail it. Until the
sender first names a ticket (a heartbeat or a push), the sender's process
counts instead: it may not have read the ticket yet (its HTTP server's queue,
or this worker's own, when one request hands out a thousand tickets at once),
so any message from that peer restarts the deadline, and the ticket fails
when the peer is silent for ``kv_transfer_timeout`` or has not named it within
``step_timeout`` (no queue holds a ticket that long).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pd_cluster.transfer import protocol
from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.descriptors import validate_pages
from pd_cluster.transfer.errors import PeerDiedError, ProtocolError, TransferAbortedError, TransferError, TransferTimeoutError
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver_events import PagesReleased, ReceiverEvents, RecvDone, RecvFailed
from pd_cluster.transfer.ticket import KVTicket
from pd_cluster.transfer.tp_plan import HeadSlice, PageGeometry

logger = logging.getLogger(__name__)

_CLOSED = 4096
SCAN_INTERVAL_S = 0.02  # the most often `poll` walks every transfer for deadlines and quarantines (seconds)


@dataclass
class _Expect:
    ticket: KVTicket
    created: float
    last_progress: float
    pushes: dict[int, protocol.Push] = field(default_factory=dict)
    pages_arrived: int = 0
    first_push_at: float | None = None
    total: int = 0
    error: TransferError | None = None
    release_at: float = 0.0
    heartbeats: int = 0
    page_nbytes: int = 0  # bytes each page receives: the whole page, or the ticket's KV heads of it

    @property
    def peer(self) -> str:
        return self.ticket.prefill_agent


class KVReceiver:
    """Tracks the transfers into this worker's pool.

    Args:
        agent: this worker's `TransferAgent`.
        metrics: where the queue depth and failures are recorded.
        clock: monotonic seconds (tests may pass a fake).
    """

    def __init__(self, agent: TransferAgent, metrics: TransferMetrics, clock=time.monotonic) -> None:
        self.agent = agent
        self.metrics = metrics
        self.config = agent.config
        self._clock = clock
        self._jobs: dict[str, _Expect] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._failures: list[RecvFailed] = []
        self._seq = 0
        self._next_ping = 0.0
        self._next_scan = 0.0
        self._peer_heard: dict[str, float] = {}  # when each sender last sent anything (`_silent_since`)

    @property
    def num_waiting(self) -> int:
        return sum(1 for j in self._jobs.values() if j.error is None)

    @property
    def num_quarantined(self) -> int:
        return sum(1 for j in self._jobs.values() if j.error is not None)

    @property
    def has_work(self) -> bool:
        """True while a transfer waits or a failed one's pages are not released: keep calling `poll`."""
        return bool(self._jobs)

    def expect(self, request_id: str, pages, num_tokens: int, prefill_agent: str, first_page: int = 0,
               group_first_pages: tuple[int, ...] = ()) -> KVTicket:
        """`expect_heads` of whole pages (the `Receiver` protocol's call)."""
        return self.expect_heads(request_id, pages, num_tokens, prefill_agent, first_page, group_first_pages)

    def expect_heads(self, request_id: str, pages, num_tokens: int, prefill_agent: str, first_page: int = 0,
                     group_first_pages: tuple[int, ...] = (), heads: tuple[tuple[int, int, int], ...] = ()
                     ) -> KVTicket:
        """Register reserved `pages` for a request's prompt KV and make the ticket for the prefill worker.

        The deadline starts now.

        Args:
            pages: the pages to fill, for the prompt's pages ``[first_page, ceil(num_tokens / page_size))``.
            num_tokens: the whole prompt's tokens.
            first_page: leading prompt pages this worker already holds (a delta transfer; `KVTicket`).
            group_first_pages: a hybrid pool's first received page per KV group; `pages` are then the slots of
                `KVTicket` (`group_slots`).
            heads: the KV head slices this peer sends (`KVTicket.heads`), when the TP sizes differ; empty: whole
                pages.

        Raises:
            PeerNotConnectedError: the prefill agent's metadata is not loaded.
            ValueError: pages outside this pool, repeated, or not matching `num_tokens` and `first_page`.
        """
        self.agent.peer(prefill_agent)
        arr = np.asarray(pages, dtype=np.int64)
        validate_pages(arr, self.agent.pool.num_pages, "decode")
        self._seq += 1
        tid = f"{request_id}@{self.agent.incarnation}.{self._seq}"
        ticket = KVTicket(tid, request_id, self.agent.name, prefill_agent, tuple(int(p) for p in arr), num_tokens,
                          self.agent.pool.page_size, first_page, tuple(group_first_pages), tuple(heads))
        now = self._clock()
        page_nbytes = self.agent.page_nbytes
        if heads:
            page_nbytes = PageGeometry.of(self.agent.info.layout).slice_nbytes(tuple(HeadSlice(*h) for h in heads))
        self._jobs[tid] = _Expect(ticket, now, now, page_nbytes=page_nbytes)
        self.metrics.decode_transfer_queue.set(self.num_waiting)
        return ticket

    def abort(self, transfer_id: str, message: str = "aborted by decode") -> bool:
        """Give up a transfer (e.g. the client went away): reported failed at the next `poll`;
        its pages come back once the sender confirms it stopped (or see the module doc).

        Returns:
            False if the transfer is unknown or already over.
        """
        job = self._jobs.get(transfer_id)
        if job is None or job.error is not None:
            return False
        self._fail(job, TransferAbortedError(message, side="decode", transfer_id=transfer_id, peer=job.peer),
                   self._clock(), cancel=True)
        return True

    def progress(self, transfer_id: str) -> list[protocol.Push]:
        """The pushes of a transfer in progress that have arrived so far, by index ([] if unknown)."""
        job = self._jobs.get(transfer_id)
        return [] if job is None else [job.pushes[i] for i in sorted(job.pushes)]

    def withdraw(self, transfer_id: str) -> tuple[int, ...]:
        """Drop a ticket the prefill worker refused (e.g. `StalePeerError`): nothing was or will be
        written, so its pages are returned for freeing at once.

        Returns:
            The pages to free; empty when the transfer is already over (a liveness probe may have
            failed it first; its pages then come or came in a `PagesReleased`).

        Raises:
            ValueError: a push of it arrived, so the prefill worker did accept it (use `abort`).
        """
        job = self._jobs.get(transfer_id)
        if job is None:
            return ()
        if job.pushes:
            raise ValueError(f"transfer {transfer_id} already received {len(job.pushes)} pushes; abort it instead")
        self._forget(job)
        self.metrics.decode_transfer_queue.set(self.num_waiting)
        return job.ticket.dst_pages

    def peer_failed(self, prefill_agent: str, message: str) -> None:
        """The caller learnt the peer is unreachable (e.g. its control connection broke): fail its transfers now."""
        now = self._clock()
        for job in list(self._jobs.values()):
            if job.peer == prefill_agent and job.error is None:
                self._fail(job, PeerDiedError(message, transfer_id=job.ticket.transfer_id, peer=prefill_agent), now,
                           cancel=True)
        self._next_ping = now  # probe it at the next poll: a dead process frees the pages at once

    def poll(self) -> ReceiverEvents:
        """Take arrived notifications, declare completions, enforce the deadline, release safe pages."""
        now = self._clock()
        ev = ReceiverEvents()
        self._drain_failures(ev)
        pushed: set[str] = set()
        for peer, msg in self.agent.take(protocol.Push, protocol.Stopped, protocol.Alive):
            self._peer_heard[peer] = now
            if isinstance(msg, protocol.Alive):
                self._on_alive(peer, msg, now)
            else:
                self._on_message(peer, msg, now, ev)
                if isinstance(msg, protocol.Push):
                    pushed.add(msg.transfer_id)
        if now >= self._next_ping:
            self._next_ping = now + self.config.heartbeat_interval
            self._heartbeat(now, ev)
        for tid in pushed:  # only a push completes a transfer
            job = self._jobs.get(tid)
            if job is not None and job.error is None and self._complete(job):
                self._finish(job, now, ev)
        if now >= self._next_scan:
            self._scan(now, ev)
        elif ev.completed:
            self.metrics.decode_transfer_queue.set(self.num_waiting)
        self._drain_failures(ev)
        return ev

    def _scan(self, now: float, ev: ReceiverEvents) -> None:
        """Enforce deadlines and end quarantines: a walk over every transfer, so at most every `SCAN_INTERVAL_S`
        (deadlines are seconds long); `poll` runs it, often while the engine waits on nothing else."""
        self._next_scan = now + min(SCAN_INTERVAL_S, self.config.kv_transfer_timeout / 10)
        for job in list(self._jobs.values()):
            if job.error is None and now - self._silent_since(job, now) > self.config.kv_transfer_timeout:
                self._fail(job, TransferTimeoutError(self._timeout_message(job, now),
                                                     transfer_id=job.ticket.transfer_id, peer=job.peer), now,
                           cancel=True)
            elif job.error is not None and now >= job.release_at:
                logger.warning("KV transfer %s: releasing %d pages after the %.1f s quarantine without the sender's "
                               "confirmation", job.ticket.transfer_id, job.ticket.num_pages, self.config.quarantine)
                self._release(job, "quarantine expired", ev)
        self.metrics.decode_transfer_queue.set(self.num_waiting)

    # ---- internals -----------------------------------------------------------
    def _silent_since(self, job: _Expect, now: float) -> float:
        """When the deadline of `job` started: its own last push or heartbeat once the sender named it; before
        that, the sender process's last message too, for at most `step_timeout` (module doc)."""
        if job.heartbeats or job.pushes:
            return job.last_progress
        if now - job.created > self.config.step_timeout:
            return job.created
        return max(job.last_progress, self._peer_heard.get(job.peer, 0.0))

    def _timeout_message(self, job: _Expect, now: float) -> str:
        head = f"transfer {job.ticket.transfer_id} from {job.peer}: "
        if not (job.heartbeats or job.pushes) and now - job.created > self.config.step_timeout:
            return (head + f"the prefill worker did not take the ticket in {now - job.created:.1f} s "
                    f"(--kv-transfer-step-timeout {self.config.step_timeout:.1f} s)")
        return (head + f"no push or heartbeat for {self.config.kv_transfer_timeout:.1f} s (--kv-transfer-timeout); "
                f"{len(job.pushes)} pushes, {job.pages_arrived}/{job.ticket.num_pages} pages arrived, "
                f"{job.heartbeats} heartbeats")

    def _on_message(self, peer: str, msg, now: float, ev: ReceiverEvents) -> None:
        if isinstance(msg, protocol.Stopped):  # whatever it concerns, the sender may stop waiting
            self._ack(peer, msg.transfer_id, "stopped")
        job = self._jobs.get(msg.transfer_id)
        if job is None:
            level = logging.DEBUG if msg.transfer_id in self._closed else logging.WARNING
            logger.log(level, "KV transfer: %s for transfer %s from %s, which is not in progress here",
                       type(msg).__name__, msg.transfer_id, peer)
            return
        if peer != job.peer:
            logger.warning("KV transfer %s: ignoring %s from %s; the ticket names %s", msg.transfer_id,
                           type(msg).__name__, peer, job.peer)
            return
        if isinstance(msg, protocol.Stopped):
            if job.error is None:
                self._fail(job, TransferAbortedError(f"prefill stopped transfer {msg.transfer_id} ({msg.reason}): "
                                                     f"{msg.message}", side="prefill",
                                                     transfer_id=msg.transfer_id, peer=peer), now, cancel=False)
            self._release(job, "sender stopped", ev)
            return
        if job.error is not None:
            return
        try:
            self._record(job, msg, now)
        except ProtocolError as e:
            self._fail(job, e, now, cancel=True)

    def _on_alive(self, peer: str, msg: protocol.Alive, now: float) -> None:
        """The sender is alive and working on these transfers: their deadlines restart (ours and the ticket's
        peer's only; a failed transfer stays failed)."""
        for tid in msg.transfer_ids:
            job = self._jobs.get(tid)
            if job is not None and job.peer == peer and job.error is None:
                job.last_progress = max(job.last_progress, now)
                job.heartbeats += 1

    def _record(self, job: _Expect, push: protocol.Push, now: float) -> None:
        t = job.ticket
        bad = None
        if push.index in job.pushes:
            bad = f"push {push.index} arrived twice"
        elif push.page_start < 0 or push.num_pages < 1 or push.page_start + push.num_pages > t.num_pages:
            bad = f"push {push.index} covers pages [{push.page_start}, +{push.num_pages}) of {t.num_pages}"
        elif push.nbytes != push.num_pages * job.page_nbytes:
            bad = f"push {push.index} claims {push.nbytes} bytes for {push.num_pages} pages"
        elif push.total and (job.total or push.total <= push.index):
            bad = f"push {push.index} says there are {push.total} pushes"
        if bad:
            raise ProtocolError(f"transfer {t.transfer_id} from {job.peer}: {bad}", transfer_id=t.transfer_id,
                                peer=job.peer)
        job.pushes[push.index] = push
        self.metrics.received_bytes.inc(push.nbytes)
        job.pages_arrived += push.num_pages
        job.total = push.total or job.total
        job.last_progress = now
        if job.first_push_at is None:
            job.first_push_at = now

    def _complete(self, job: _Expect) -> bool:
        if not job.total or len(job.pushes) < job.total:
            return False
        pos = 0
        for i in range(job.total):
            p = job.pushes.get(i)
            if p is None or p.page_start != pos:
                return False
            pos += p.num_pages
        return pos == job.ticket.num_pages

    def _finish(self, job: _Expect, now: float, ev: ReceiverEvents) -> None:
        t = job.ticket
        self._forget(job)
        self._ack(job.peer, t.transfer_id, "done")
        pushes = tuple(job.pushes[i] for i in range(job.total))
        ev.completed.append(RecvDone(t.transfer_id, t.request_id, t.dst_pages, dict(pushes[-1].meta or {}), pushes,
                                     sum(p.nbytes for p in pushes), now - job.created,
                                     now - (job.first_push_at or now)))

    def _fail(self, job: _Expect, error: TransferError, now: float, cancel: bool) -> None:
        job.error = error
        job.release_at = now + self.config.quarantine
        self.metrics.observe_failure(error.reason)
        log = logger.debug if isinstance(error, TransferAbortedError) else logger.warning  # the worker logs aborts
        log("KV transfer %s (request %s) from %s failed: %s", job.ticket.transfer_id, job.ticket.request_id, job.peer,
            error)
        self._failures.append(RecvFailed(job.ticket.transfer_id, job.ticket.request_id, error))
        if cancel:
            try:
                self.agent.send(job.peer, protocol.Cancel(job.ticket.transfer_id, error.reason))
            except PeerDiedError:
                self._next_ping = now  # the next poll's probe confirms it and releases the pages
            except TransferError as e:
                logger.info("KV transfer %s: could not send cancel to %s: %s", job.ticket.transfer_id, job.peer, e)

    def _drain_failures(self, ev: ReceiverEvents) -> None:
        ev.failed.extend(self._failures)
        self._failures.clear()

    def _ack(self, peer: str, transfer_id: str, what: str) -> None:
        try:
            self.agent.send(peer, protocol.Ack(transfer_id, what))
        except TransferError as e:  # the sender stops waiting for it after its own timeout
            logger.info("KV transfer %s: could not acknowledge %s to %s: %s", transfer_id, what, peer, e)

    def _release(self, job: _Expect, why: str, ev: ReceiverEvents) -> None:
        self._forget(job)
        ev.released.append(PagesReleased(job.ticket.transfer_id, job.ticket.request_id, job.ticket.dst_pages, why))

    def _forget(self, job: _Expect) -> None:
        del self._jobs[job.ticket.transfer_id]
        self._closed[job.ticket.transfer_id] = job.peer
        while len(self._closed) > _CLOSED:
            self._closed.popitem(last=False)

    def _heartbeat(self, now: float, ev: ReceiverEvents) -> None:
        peers = {j.peer for j in self._jobs.values()}
        self._peer_heard = {p: t for p, t in self._peer_heard.items() if p in peers}  # a new ticket starts anew
        for peer in peers:
            try:
                self.agent.send(peer, protocol.Ping())
            except PeerDiedError as e:
                for job in [j for j in self._jobs.values() if j.peer == peer]:
                    if job.error is None:
                        self._fail(job, PeerDiedError(f"prefill agent {peer} is gone: {e}",
                                                      transfer_id=job.ticket.transfer_id, peer=peer), now, cancel=False)
                    self._release(job, "sender process gone", ev)
            except TransferError as e:
                logger.warning("KV transfer: liveness probe to %s failed: %s", peer, e)
