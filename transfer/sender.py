"""Prefill side: push each chunk's pages into decode's reserved pages as soon as they are written.

Usage from a prefill worker's step loop (single thread, nothing blocks)::

    sender.add_request(ticket)                       # once decode's ticket arrived
    ...after each prefill step that wrote prompt tokens [.., end) of the request:
    sender.push(ticket.transfer_id, block_table, end, meta={"first_token_id": t} if end == n else None)
    ...every step:
    ev = sender.poll()   # ev.completed: free the request's pages; ev.failed: free them and report the error

A push covers the pages that became full since the previous push; the push
that reaches the prompt's end also sends the last, partial page and carries
the number of pushes, so decode can check that every push arrived. A delta
ticket (``first_page`` > 0: decode's own cache holds the prompt's first pages)
is pushed from that page on: chunks that complete only earlier pages push
nothing, and a push's ``page_start`` counts from the ticket's first page. On GPU, a
push may wait for a CUDA event recorded after the chunk's forward pass: it is
posted by the first `poll` that finds the event complete.

Deadlines (from `TransferConfig`): a posted push older than `push_timeout` is
cancelled, and a transfer without progress or heartbeat for
`sender_idle_timeout` is stopped; both are shorter than decode's
``kv_transfer_timeout``, so a live sender has stopped writing before decode
gives up.

Heartbeats (`SenderHeartbeat`, `transfer/heartbeat.py`) keep a transfer alive
through a long chunk's forward pass, which polls nothing. A stopped transfer is
reported only once every NIXL handle of it is released (cancelled or done),
and only then does the sender tell decode it stopped: pages on both sides are
reusable exactly when the events say so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from pd_cluster.transfer import protocol
from pd_cluster.transfer.agent import DONE, ERR, TransferAgent
from pd_cluster.transfer.descriptors import page_runs, run_descs, validate_pages
from pd_cluster.transfer.errors import (NixlTransferError, PeerDiedError, StalePeerError, TransferAbortedError, TransferError,
                             TransferTimeoutError)
from pd_cluster.transfer.heartbeat import HeartbeatThread, SenderHeartbeat
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.send_jobs import SendDone, SenderEvents, SendFailed, SendJob, SendPush
from pd_cluster.transfer.ticket import KVTicket, group_slots
from pd_cluster.transfer.tp_plan import HeadSlice, PageGeometry, slice_descs

__all__ = ["KVSender", "SendDone", "SendFailed", "SenderEvents"]

logger = logging.getLogger(__name__)

_TOMBSTONES = 4096


class KVSender(SenderHeartbeat):
    """Pushes requests' KV pages from this worker's pool to decode pools (its heartbeats: `SenderHeartbeat`).

    Args:
        agent: this worker's `TransferAgent`.
        metrics: where pushes and failures are recorded.
        clock: monotonic seconds (tests may pass a fake).
    """

    def __init__(self, agent: TransferAgent, metrics: TransferMetrics, clock=time.monotonic) -> None:
        self.agent = agent
        self.metrics = metrics
        self.config = agent.config
        self._clock = clock
        self._jobs: dict[str, SendJob] = {}
        self._cancelled: OrderedDict[str, str] = OrderedDict()
        self._unacked: dict[str, float] = {}  # transfer id -> when to stop waiting for decode's Ack
        self._next_ping = 0.0
        self._jobs_lock = threading.Lock()  # the heartbeat thread reads `_jobs` and `_waiting`; others change them
        self._waiting: dict[str, tuple[str, float]] = {}  # announced, not yet added: id -> (decode agent, when)
        self._ended: OrderedDict[str, None] = OrderedDict()  # the last transfers forgotten (late announcements)
        self._last_poll = clock()  # the step loop's last `poll` (heartbeats stop when it is hung)
        self._beat = HeartbeatThread(self.heartbeat, self.config.heartbeat_period, lambda: agent.closed)

    @property
    def num_inflight(self) -> int:
        return len(self._jobs)

    @property
    def has_work(self) -> bool:
        """True while a transfer is not over or its last message is not acknowledged: keep calling `poll`
        (it is also what progresses NIXL, i.e. what moves that message out) until False."""
        return bool(self._jobs or self._unacked)

    def add_request(self, ticket: KVTicket) -> None:
        """Accept decode's ticket; pushes may follow.

        Raises:
            StalePeerError: the ticket names another incarnation of this prefill agent.
            PeerNotConnectedError: decode's agent is not connected (fetch its info, `agent.connect`).
            TransferAbortedError: decode cancelled this transfer before it arrived here.
            ValueError: duplicate transfer id, pages outside decode's pool, a page-size or KV-group-count
                mismatch, or KV head slices outside either side's heads.
        """
        if ticket.prefill_agent != self.agent.name:
            raise StalePeerError(f"ticket {ticket.transfer_id} names prefill agent {ticket.prefill_agent}, but this "
                                 f"is {self.agent.name} (restarted); refresh its metadata and retry",
                                 transfer_id=ticket.transfer_id, peer=ticket.prefill_agent)
        info = self.agent.peer(ticket.decode_agent)
        if ticket.transfer_id in self._cancelled:
            raise TransferAbortedError(f"transfer {ticket.transfer_id} was cancelled by decode before it started",
                                       side="decode", transfer_id=ticket.transfer_id, peer=ticket.decode_agent)
        if ticket.transfer_id in self._jobs:
            raise ValueError(f"transfer {ticket.transfer_id} is already in progress")
        if ticket.page_size != self.agent.pool.page_size:
            raise ValueError(f"ticket page size {ticket.page_size} != pool page size {self.agent.pool.page_size}")
        groups = getattr(self.agent.pool, "groups", None)
        if groups is not None and ticket.num_groups != groups.num_transfer_groups:
            raise ValueError(f"ticket for {ticket.num_groups} KV group(s), but this pool has "
                             f"{groups.num_transfer_groups}")
        validate_pages(np.asarray(ticket.dst_pages, dtype=np.int64), info.num_pages, f"decode ({ticket.decode_agent})")
        if ticket.heads:  # a head slice must lie within each side's heads of a page
            mine, theirs = int(self.agent.info.layout["num_kv_heads"]), int(info.layout["num_kv_heads"])
            for src, dst, n in ticket.heads:
                if src + n > mine or dst + n > theirs:
                    raise ValueError(f"ticket {ticket.transfer_id}: KV heads {src}..{src + n - 1} -> "
                                     f"{dst}..{dst + n - 1} outside {mine} local and {theirs} remote heads per page")
        now = self._last_poll = self._clock()  # the step loop's call: it is alive (an idle one polls nothing)
        with self._jobs_lock:
            self._waiting.pop(ticket.transfer_id, None)
            self._jobs[ticket.transfer_id] = SendJob(ticket, now, now, sent_pages=ticket.first_page)
        self.metrics.prefill_inflight_queue.set(len(self._jobs))

    def push(self, transfer_id: str, block_table, num_computed_tokens: int, meta: dict | None = None,
             ready_event=None, group_tables=()) -> int:
        """Push the pages that `num_computed_tokens` made complete (all remaining ones at the prompt's end).

        Args:
            block_table: the request's prefill page ids so far (covering `num_computed_tokens`); a hybrid pool's
                group 0 table.
            group_tables: a hybrid pool's block tables of groups 1.. (the ticket's `group_first_pages` say which
                of their pages decode receives: a windowed group's entries before those may be the null page).
            num_computed_tokens: prompt tokens whose KV is now written.
            meta: payload of the last push (e.g. ``{"first_token_id": 42}``); ignored otherwise.
            ready_event: an object with ``query() -> bool`` (a ``torch.cuda.Event``) recorded
                after the forward pass; the push is posted once it is complete. None: post now.

        Returns:
            The number of pages (slots: a hybrid pool's page of one group) this push covers (0: no page decode
            receives became complete; nothing posted).

        Raises:
            KeyError: unknown transfer id.
            ValueError: pages beyond the block tables or the pool, block tables for another number of KV groups
                than the ticket's, or a push after the last.
        """
        job = self._jobs[transfer_id]
        if job.error is not None:
            return 0
        if job.last_issued:
            raise ValueError(f"transfer {transfer_id}: push after the last push")
        t = job.ticket
        last = num_computed_tokens >= t.num_tokens
        # prompt page indices (job.sent_pages starts at t.first_page); the ticket's pages are slots (`KVTicket.slot`)
        end = t.num_prompt_pages if last else min(num_computed_tokens // t.page_size, t.num_prompt_pages)
        if end <= job.sent_pages:
            return 0
        lo, hi = t.slot(job.sent_pages), t.slot(end)
        if hi == lo:  # only pages behind a windowed group's window: decode reads none of them (never the last)
            job.sent_pages = end
            return 0
        try:
            src = np.asarray(group_slots([block_table, *group_tables], t.group_first_pages or (t.first_page,),
                                         job.sent_pages, end), dtype=np.int64)
        except ValueError as e:
            raise ValueError(f"transfer {transfer_id}: {e} (push to page {end})") from e
        validate_pages(src, self.agent.pool.num_pages, "prefill")
        dst = np.asarray(t.dst_pages[lo:hi], dtype=np.int64)
        info = self.agent.peer(job.peer)
        if t.heads:  # the TP sizes differ: this part's KV heads of each page (`pd_cluster.transfer.tp_plan`)
            slices = tuple(HeadSlice(*h) for h in t.heads)
            mine, theirs = PageGeometry.of(self.agent.info.layout), PageGeometry.of(info.layout)
            nbytes = src.size * mine.slice_nbytes(slices)
            local = slice_descs(self.agent.info.kv_base, mine, src, slices, True, self.agent.device_id)
            remote = slice_descs(info.kv_base, theirs, dst, slices, False, info.device_id)
        else:
            runs = page_runs(src, dst)
            nbytes = runs.num_pages * self.agent.page_nbytes
            local = run_descs(self.agent.info.kv_base, self.agent.page_nbytes, runs.src_start, runs.length,
                              self.agent.device_id)
            remote = run_descs(info.kv_base, info.page_nbytes, runs.dst_start, runs.length, info.device_id)
        index = len(job.pushes)
        msg = protocol.Push(transfer_id, index, lo, hi - lo, nbytes,
                            total=index + 1 if last else 0, meta=(meta or {}) if last else None)
        p = SendPush(msg, local, remote, ready_event)
        job.pushes.append(p)
        job.sent_pages, job.last_issued = end, last
        if ready_event is None:
            self._post(job, p)
        return msg.num_pages

    def abort(self, transfer_id: str, message: str = "aborted by prefill") -> bool:
        """Stop a transfer (e.g. the client went away). Its end is reported by `poll` as failed.

        Returns:
            False if the transfer is unknown or already finished.
        """
        job = self._jobs.get(transfer_id)
        if job is None:
            return False
        if job.error is None:
            self._stop(job, TransferAbortedError(message, side="prefill", transfer_id=transfer_id, peer=job.peer))
        return True

    def poll(self) -> SenderEvents:
        """Advance every transfer: post ready pushes, reap completions, enforce deadlines, handle cancels."""
        now = self._last_poll = self._clock()
        ev = SenderEvents()
        for peer, msg in self.agent.take(protocol.Cancel, protocol.Ack):
            if isinstance(msg, protocol.Ack):
                self._unacked.pop(msg.transfer_id, None)
            else:
                self._on_cancel(peer, msg)
        for tid, until in list(self._unacked.items()):
            if now > until:
                del self._unacked[tid]
                logger.warning("KV transfer %s: decode never acknowledged the last message", tid)
        if now >= self._next_ping:
            self._next_ping = now + self.config.heartbeat_interval
            self._heartbeat()
        for job in list(self._jobs.values()):
            if job.error is None:
                self._advance(job, now)
            if job.error is not None:
                self._finish_stop(job, ev)
            elif job.last_issued and all(p.done for p in job.pushes):
                self._forget(job)
                ev.completed.append(SendDone(job.ticket.transfer_id, job.ticket.request_id, len(job.pushes),
                                             job.nbytes, now - job.started))
        self.metrics.prefill_inflight_queue.set(len(self._jobs))
        return ev

    # ---- internals -----------------------------------------------------------
    def _forget(self, job: SendJob) -> None:
        with self._jobs_lock:
            del self._jobs[job.ticket.transfer_id]
            self._ended[job.ticket.transfer_id] = None
            while len(self._ended) > _TOMBSTONES:
                self._ended.popitem(last=False)

    def _post(self, job: SendJob, p: SendPush) -> None:
        """Post one push's WRITE, unless the transfer went idle past `sender_idle_timeout` first.

        The check is made here, just before the WRITE, and not only in `poll`: a process frozen (SIGSTOP, a VM
        pause) for longer than decode's quarantine wakes up mid-step and would otherwise post that step's push
        into pages decode has since given to another request (sglang #30233, "garbage after an aborted prefill").
        Decode releases an unconfirmed failed transfer's pages a quarantine (default `kv_transfer_timeout`) after
        the failure, itself after the last progress; `sender_idle_timeout` is half of that, so a push that passes
        this check is posted before decode may reuse the pages. What stays open is a stall between this check
        and the WRITE call itself (docs/transfer.md, Known limits).
        """
        idle = self._clock() - job.live_since
        if idle > self.config.sender_idle_timeout:
            tid = job.ticket.transfer_id
            self._stop(job, TransferTimeoutError(
                f"transfer {tid}: push {p.msg.index} not posted, no progress or heartbeat for {idle:.1f} s (more "
                f"than {self.config.sender_idle_timeout:.1f} s; this process was stalled)", transfer_id=tid,
                peer=job.peer))
            return
        p.started = time.perf_counter()
        try:
            p.handle, state = self.agent.write(job.peer, p.local, p.remote)
        except TransferError as e:
            e.transfer_id = job.ticket.transfer_id
            self._stop(job, e)
            return
        p.posted_at = self._clock()
        if state == DONE:  # moved within the post itself (e.g. a shared-memory copy): its latency is the post's
            self._complete(job, p, p.posted_at)

    def _complete(self, job: SendJob, p: SendPush, now: float) -> None:
        """The WRITE is done (flushed: the bytes are in decode's pages); now tell decode.

        The notification is sent on its own, after completion, rather than attached to the WRITE:
        an attached one makes the WRITE's completion wait for a round trip through decode's
        progress (i.e. decode's next poll), measured here; sent after completion it is still
        ordered after the data.
        """
        p.done = True
        elapsed = time.perf_counter() - p.started
        self.agent.release(p.handle)
        p.handle = None
        job.nbytes += p.msg.nbytes
        job.last_progress = now
        self.metrics.observe_push(p.msg.nbytes, elapsed, p.local.shape[0])
        try:
            self.agent.send(job.peer, p.msg)
        except TransferError as e:
            e.transfer_id = job.ticket.transfer_id
            self._stop(job, e)
            return
        if p.msg.is_last:
            self._expect_ack(job.ticket.transfer_id, now)

    def _expect_ack(self, transfer_id: str, now: float) -> None:
        self._unacked[transfer_id] = now + self.config.sender_idle_timeout

    def _advance(self, job: SendJob, now: float) -> None:
        tid = job.ticket.transfer_id
        for p in job.pushes:
            if p.done:
                continue
            if p.handle is None:
                if p.ready is not None and p.ready.query():
                    self._post(job, p)
                    if job.error is not None:
                        return
                continue
            try:
                state = self.agent.check(p.handle, job.peer)
            except TransferError as e:
                e.transfer_id = tid
                self._stop(job, e)
                return
            if state == DONE:
                self._complete(job, p, now)
                if job.error is not None:
                    return
            elif state == ERR:
                self._stop(job, NixlTransferError(f"push {p.msg.index} of {tid} to {job.peer} failed in NIXL",
                                                  transfer_id=tid, peer=job.peer))
                return
            elif now - p.posted_at > self.config.push_timeout:
                self._stop(job, TransferTimeoutError(
                    f"push {p.msg.index} of {tid} ({p.msg.nbytes} bytes) to {job.peer} did not complete in "
                    f"{self.config.push_timeout:.1f} s", transfer_id=tid, peer=job.peer))
                return
        if now - job.live_since > self.config.sender_idle_timeout:
            self._stop(job, TransferTimeoutError(
                f"transfer {tid} made no progress and sent no heartbeat for {self.config.sender_idle_timeout:.1f} s "
                f"({len(job.pushes)} pushes issued)", transfer_id=tid, peer=job.peer))

    def _stop(self, job: SendJob, error: TransferError) -> None:
        job.error = error
        self.metrics.observe_failure(error.reason)
        log = logger.debug if isinstance(error, TransferAbortedError) else logger.warning  # the worker logs aborts
        log("KV transfer %s (request %s) to %s stopping: %s", job.ticket.transfer_id, job.ticket.request_id,
            job.peer, error)

    def _finish_stop(self, job: SendJob, ev: SenderEvents) -> None:
        """Release every handle; once none is left, tell decode and report the failure."""
        pending = False
        for p in job.pushes:
            if p.handle is not None and not p.done:
                if self.agent.release(p.handle):
                    p.handle = None
                else:
                    pending = True
        if pending:
            return
        self._forget(job)
        if not isinstance(job.error, PeerDiedError):
            try:
                self.agent.send(job.peer, protocol.Stopped(job.ticket.transfer_id, job.error.reason, str(job.error),
                                                           ack=job.ack))
                self._expect_ack(job.ticket.transfer_id, self._clock())
            except TransferError as e:
                logger.info("KV transfer %s: could not tell %s it stopped: %s", job.ticket.transfer_id, job.peer, e)
        ev.failed.append(SendFailed(job.ticket.transfer_id, job.ticket.request_id, job.error))

    def _on_cancel(self, peer: str, msg: protocol.Cancel) -> None:
        job = self._jobs.get(msg.transfer_id)
        if job is not None and job.peer == peer:
            job.ack = True
            if job.error is None:
                self._stop(job, TransferAbortedError(f"decode cancelled transfer {msg.transfer_id}: {msg.reason}",
                                                     side="decode", transfer_id=msg.transfer_id, peer=peer))
            return
        # Not started here (ticket still on its way) or already over: nothing is in flight; confirm at once,
        # and remember it so a late ticket is refused.
        with self._jobs_lock:  # in one step with the withdrawal: a late announcement (TP) sees it cancelled
            self._waiting.pop(msg.transfer_id, None)
            self._cancelled[msg.transfer_id] = peer
            while len(self._cancelled) > _TOMBSTONES:
                self._cancelled.popitem(last=False)
        try:
            self.agent.send(peer, protocol.Stopped(msg.transfer_id, "aborted", "no transfer in flight", ack=True))
            self._expect_ack(msg.transfer_id, self._clock())
        except TransferError as e:
            logger.info("KV transfer %s: could not confirm cancel to %s: %s", msg.transfer_id, peer, e)
