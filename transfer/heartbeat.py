"""The KV sender's heartbeats: what each round sends (`SenderHeartbeat`, `KVSender`'s) and the thread that runs
the rounds (`HeartbeatThread`) while the step loop computes.

The step loop polls nothing during a forward pass, so the heartbeat cannot come from it: a daemon thread calls
the sender's `heartbeat` every period. SIGSTOP and kill stop this thread with the process, which is what lets
decode's deadline still find a frozen or dead prefill (docs/transfer.md, Deadlines).

Heartbeats measure silence, not compute. A chunk's forward pass may run longer
than the deadline (the last chunks of a 10M-token prompt take seconds each),
and the step loop polls nothing meanwhile. So `heartbeat`, run every
`heartbeat_period` by a thread of its own (`start_heartbeat`), sends decode an
`Alive` naming this process's transfers: decode's deadline restarts for each.
Every connected decode peer gets one each period, naming none if need be: a
ticket this process has not read yet (it waits in its HTTP server's queue, or
in decode's own send queue, when a 1,000-prompt request hands out tickets at
once) is then kept alive by the process's life (`KVReceiver`). A process frozen (SIGSTOP, a VM pause) or killed sends none, so decode's
deadline and its liveness probe find it as before; a step loop that has not
polled for `step_timeout` is taken as hung and is vouched for no more. A
heartbeat is never sent for a transfer already idle past
`sender_idle_timeout` and counts from the time just before it was sent, so
the rule "post nothing past `sender_idle_timeout` without progress or
heartbeat" keeps every WRITE before decode's deadline for the last heartbeat
it accepted (docs/transfer.md, Deadlines).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pd_cluster.transfer import protocol
from pd_cluster.transfer.errors import PeerDiedError, TransferError
from pd_cluster.transfer.send_jobs import SendJob
from pd_cluster.transfer.ticket import KVTicket

logger = logging.getLogger(__name__)

_ALIVE_IDS = 32  # transfer ids per heartbeat notification


class HeartbeatThread:
    """Calls `beat` every `period` seconds on a daemon thread, until `stop` or until `done()` is true.

    Args:
        beat: one heartbeat round (`KVSender.heartbeat`); its exceptions are logged, never end the thread.
        period: seconds between rounds (`TransferConfig.heartbeat_period`).
        done: checked before each round (e.g. the agent closed).
    """

    def __init__(self, beat: Callable[[], object], period: float, done: Callable[[], bool]) -> None:
        self.beat = beat
        self.period = period
        self.done = done
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-heartbeat", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.period) and not self.done():
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the thread must go on: without it a long chunk would time out
                logger.exception("KV transfer: heartbeat round failed")


class SenderHeartbeat:
    """`KVSender`'s heartbeats and liveness probes (a mixin: `KVSender` owns the transfers, the announced
    tickets and the lock it reads them under)."""

    def announce(self, ticket: KVTicket) -> None:
        """A ticket arrived and waits for the engine thread (the current step may be a long chunk): heartbeats
        name it until `add_request` or `withdraw_announced`. Safe from any thread; nothing is posted for it
        before `add_request`."""
        self.announce_id(ticket.transfer_id, ticket.decode_agent)

    def announce_id(self, transfer_id: str, decode_agent: str) -> None:
        """`announce` by id. An announcement that comes after `add_request` (under TP it travels apart from the
        step loop's commands, `pd_cluster.transfer.tp`) is dropped, for a transfer in flight or one of the
        last `_TOMBSTONES` that ended or that decode cancelled. An announcement left waiting longer than
        `step_timeout` is dropped by the heartbeat (no step takes that long), so none is named forever."""
        with self._jobs_lock:
            if not (transfer_id in self._jobs or transfer_id in self._ended or transfer_id in self._cancelled):
                self._waiting[transfer_id] = (decode_agent, self._clock())

    def withdraw_announced(self, transfer_id: str) -> None:
        """The announced ticket will not be added (refused, or the request went away). Safe from any thread."""
        with self._jobs_lock:
            self._waiting.pop(transfer_id, None)

    def heartbeat(self) -> int:
        """Tell each decode peer that this process is alive and working on its transfers (`protocol.Alive`);
        a connected peer with none of them gets an `Alive` naming none (the process lives).

        Safe from any thread (`start_heartbeat` runs it on its own). Nothing is sent for a transfer that
        already failed or has been idle (no progress, no heartbeat) past `sender_idle_timeout` (the step
        loop stops it, posting nothing), nor at all while the step loop has not polled for `step_timeout`
        (taken as hung). A failed send is left to the step loop's liveness probe.

        Returns:
            The number of transfers vouched for.
        """
        now = self._clock()
        if now - self._last_poll > self.config.step_timeout:
            return 0
        with self._jobs_lock:
            jobs = [j for j in self._jobs.values() if j.error is None]
            for tid in [t for t, (_, since) in self._waiting.items() if now - since > self.config.step_timeout]:
                del self._waiting[tid]  # never added nor withdrawn (a lost add, a late announcement)
            waiting = [(tid, peer) for tid, (peer, _) in self._waiting.items()]
        by_peer: dict[str, list[tuple[str, SendJob | None]]] = {}
        for job in jobs:
            if now - job.live_since <= self.config.sender_idle_timeout:
                by_peer.setdefault(job.peer, []).append((job.ticket.transfer_id, job))
        for tid, peer in waiting:  # no push can be posted before `add_request`, which restarts its clock
            if self.agent.is_connected(peer):
                by_peer.setdefault(peer, []).append((tid, None))
        for peer in self.agent.peer_names:  # the process lives: tickets not read yet (an HTTP queue) may wait
            by_peer.setdefault(peer, [])
        vouched = 0
        for peer, group in by_peer.items():
            for i in range(0, max(len(group), 1), _ALIVE_IDS):  # a notification stays small (tens of ids)
                part = group[i:i + _ALIVE_IDS]
                try:
                    self.agent.send(peer, protocol.Alive(tuple(tid for tid, _ in part)), progress_data=False)
                except TransferError as e:
                    logger.debug("KV transfer: heartbeat to %s failed: %s", peer, e)
                    break
                for _, job in part:
                    if job is not None:
                        job.vouched = max(job.vouched, now)
                vouched += len(part)
        return vouched

    def start_heartbeat(self) -> None:
        """Run `heartbeat` every `heartbeat_period` on a daemon thread until `stop_heartbeat` or the agent closes."""
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._beat.stop()

    def _heartbeat(self) -> None:
        for peer in {j.peer for j in self._jobs.values() if j.error is None}:
            try:
                self.agent.send(peer, protocol.Ping())
            except PeerDiedError as e:
                for job in self._jobs.values():
                    if job.peer == peer and job.error is None:
                        self._stop(job, PeerDiedError(f"decode agent {peer} is gone: {e}",
                                                      transfer_id=job.ticket.transfer_id, peer=peer))
            except TransferError as e:
                logger.warning("KV transfer: liveness probe to %s failed: %s", peer, e)
