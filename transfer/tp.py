"""KV transfer under tensor parallelism: one agent per rank, each rank exchanging its own KV heads.

Every rank of a worker holds its own pool (its share of the KV heads, or the
whole MLA latent) and its own `TransferAgent`; all ranks use the same page ids
(rank 0's allocator). Rank 0 serves one `AgentInfo` whose ``tp_peers`` lists
ranks 1..N-1, and drives every rank through the proxies here, which keep the
single-agent API of `KVSender` / `KVReceiver`, so the prefill and decode
workers use them unchanged. The two workers' TP sizes may differ: the
handshake plans the parts of a transfer (`pd_cluster.transfer.tp_plan`: which
prefill rank sends which heads to which decode rank; with equal sizes rank r
to rank r, whole pages), and each rank connects to the peer ranks of its parts.

- `TPTicket` (in `pd_cluster.transfer.ticket`): the tickets of one request, one per part, sent as one JSON object.
- `TPAgent`, `TPSender`, `TPReceiver`: rank 0's view. Each call runs on every
  rank (`pd_cluster.engine.executor.tp.TPDriver`); `poll` gathers the ranks' events and
  merges them: a transfer is complete when every part is, failed as soon
  as one part fails (the other parts are then aborted), and its pages are
  reusable only once every part has released them or completed.
- `RankTransfer` (`pd_cluster.transfer.tp_rank`): what each rank holds, installed on all ranks by the worker.

A TP-1 worker uses the same proxies over one in-process rank (`pd_cluster.transfer.factory.LocalDriver`), so a
TP-1 worker meets a TP-N peer the same way; a transfer of one part keeps the single-pool ticket on the wire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pd_cluster.transfer.errors import StalePeerError
from pd_cluster.transfer.layout import AgentInfo
from pd_cluster.transfer.receiver_events import PagesReleased, ReceiverEvents, RecvDone, RecvFailed
from pd_cluster.transfer.sender import SendDone, SenderEvents, SendFailed
from pd_cluster.transfer.ticket import KVTicket, TPTicket
from pd_cluster.transfer.tp_rank import EXTENSION, RankTransfer, install, on_ranks

__all__ = ["EXTENSION", "RankTransfer", "TPAgent", "TPReceiver", "TPSender", "install", "on_ranks"]

logger = logging.getLogger(__name__)

MIN_POLL_INTERVAL_S = 0.001  # a poll is two collectives; the step loop may ask far more often


class TPAgent:
    """Rank 0's stand-in for a `TransferAgent` (the handshake runs on every rank)."""

    def __init__(self, driver, infos: list[AgentInfo]) -> None:
        self.driver = driver
        self.name = infos[0].agent_name
        self.incarnation = infos[0].incarnation
        self.info = replace(infos[0], tp_peers=tuple(infos[1:]))
        self.conversions: dict[str, str] = {}  # peer worker (rank 0's agent) -> what the transfer converts
        self._connected: set[str] = set()

    @property
    def connects_off_thread(self) -> bool:
        """Under TP, False: the handshake is a call on every rank, which must not interleave with a step's calls.
        One rank (`pd_cluster.transfer.factory.LocalDriver`): True, as `TransferAgent`'s."""
        return self.driver.tp.size == 1

    def is_connected(self, name: str) -> bool:
        return name in self._connected

    def connect(self, info: AgentInfo) -> None:
        """Raises: LayoutMismatchError (from any rank) as `TransferAgent.connect`; ValueError."""
        what = on_ranks(self.driver, RankTransfer.connect, info, gather=False)
        if what and info.agent_name not in self.conversions and "whole pages" not in what:
            logger.info("KV transfer %s <-> %s: converting %s", self.name, info.agent_name, what)
        self.conversions[info.agent_name] = what
        self._connected.add(info.agent_name)

    def disconnect(self, name: str) -> None:
        on_ranks(self.driver, RankTransfer.disconnect, name)
        self._connected.discard(name)
        self.conversions.pop(name, None)

    def close(self) -> None:
        on_ranks(self.driver, RankTransfer.close)


@dataclass
class _Parts:
    """Rank 0's record of one transfer's parts (`pd_cluster.transfer.tp_plan.Part`), by index."""

    tids: tuple[str, ...]
    request_id: str
    remote: tuple[bool, ...] = ()  # per part: moved by another rank than 0 (its bytes are added to rank 0's metrics)
    done: dict[int, object] = field(default_factory=dict)      # part -> SendDone / RecvDone
    failed: dict[int, object] = field(default_factory=dict)    # part -> SendFailed / RecvFailed
    released: dict[int, object] = field(default_factory=dict)  # part -> PagesReleased (decode)
    reported: bool = False
    aborted: bool = False

    def other_ranks_bytes(self) -> int:
        return sum(x.nbytes for i, x in self.done.items() if i < len(self.remote) and self.remote[i])


class _TPProxy:
    def __init__(self, driver) -> None:
        self.driver = driver
        self.size = driver.tp.size
        self.parts: dict[str, _Parts] = {}
        self._part_of: dict[str, tuple[str, int]] = {}  # a rank's transfer id -> (the TP transfer id, its part)
        self._has_work = False
        self._last_poll = 0.0

    @property
    def has_work(self) -> bool:
        return bool(self.parts) or self._has_work

    def _gather(self, method: Callable) -> list | None:
        now = time.monotonic()
        if self.size > 1 and now - self._last_poll < MIN_POLL_INTERVAL_S:
            return None
        self._last_poll = now
        results = on_ranks(self.driver, method)
        self._has_work = any(r[1] for r in results)
        return [r[0] for r in results]

    def _add(self, tid0: str, p: _Parts) -> None:
        self.parts[tid0] = p
        for i, tid in enumerate(p.tids):
            self._part_of[tid] = (tid0, i)

    def _drop(self, tid0: str) -> None:
        for tid in self.parts.pop(tid0).tids:
            self._part_of.pop(tid, None)

    def _file(self, events: list, kinds: dict) -> list[tuple[str, _Parts]]:
        """Put each rank's event into its part (``kinds``: event type -> the `_Parts` field it fills); returns
        the parts that got one, once each, in order. A poll costs what its events do, not what is in flight:
        the engine thread polls often, and a walk over a thousand transfers each time starved its process."""
        touched: dict[str, _Parts] = {}
        for ev in events:
            for item in (x for name in ("completed", "failed", "released") for x in getattr(ev, name, ())):
                tid0, i = self._part_of.get(item.transfer_id, (None, None))
                if tid0 is None:
                    continue
                p = self.parts[tid0]
                getattr(p, kinds[type(item)])[i] = item
                touched[tid0] = p
        return list(touched.items())

    def _rank0(self) -> RankTransfer:
        """Rank 0's own `RankTransfer` (its metrics are the ones the worker serves)."""
        return self.driver.local.extensions[EXTENSION]

    def _abort_rest(self, p: _Parts, method: Callable, message: str) -> None:
        if not p.aborted:
            p.aborted = True
            on_ranks(self.driver, method, p.tids, message)


def _as_tp(ticket) -> TPTicket:
    if isinstance(ticket, KVTicket):
        return TPTicket((ticket,))
    if not isinstance(ticket, TPTicket):
        raise ValueError(f"not a KV ticket: {type(ticket).__name__}")
    return ticket


class TPSender(_TPProxy):
    """Rank 0's `KVSender` for all ranks.

    Args:
        agents: every rank's agent name in rank order (`TPAgent`): a ticket's parts must name them.
    """

    def __init__(self, driver, agents: tuple[str, ...] = ()) -> None:
        super().__init__(driver)
        self.agents = tuple(agents)
        self._announced: dict[str, tuple[str, ...]] = {}  # announced, not yet added: transfer id -> parts' ids
        self._announced_lock = threading.Lock()  # the HTTP handler announces; the engine thread adds

    @property
    def num_inflight(self) -> int:
        return len(self.parts)

    def _check(self, ticket) -> TPTicket:
        ticket = _as_tp(ticket)
        if self.agents:
            stray = [t.prefill_agent for t in ticket.tickets if t.prefill_agent not in self.agents]
            if stray:  # decode's metadata of this worker predates its restart: it refreshes and retries
                raise StalePeerError(f"ticket {ticket.transfer_id} names prefill agent {stray[0]}, not a rank of "
                                     f"this TP-{self.size} worker ({', '.join(self.agents)}; restarted); refresh "
                                     "its metadata and retry", transfer_id=ticket.transfer_id, peer=stray[0])
        elif len(ticket.tickets) != self.size:
            raise ValueError(f"a TP-{self.size} prefill worker needs one ticket per rank")
        return ticket

    def add_request(self, ticket: TPTicket) -> None:
        ticket = self._check(ticket)
        on_ranks(self.driver, RankTransfer.sender_add, ticket.tickets)  # raises: the caller withdraws the ticket
        with self._announced_lock:
            self._announced.pop(ticket.transfer_id, None)
        rank0 = self.agents[0] if self.agents else None
        remote = tuple((t.prefill_agent != rank0) if rank0 else i > 0 for i, t in enumerate(ticket.tickets))
        self._add(ticket.transfer_id, _Parts(tuple(t.transfer_id for t in ticket.tickets), ticket.request_id, remote))

    def announce(self, ticket: TPTicket) -> None:
        """`KVSender.announce` on every rank, from the caller's thread (the HTTP handler's) while the engine
        thread may be inside a long step: rank 0's at once, the others' through the driver's side channel
        (`TPDriver.post`), so every rank's heartbeats name its parts of the ticket while it waits."""
        ticket = self._check(ticket)
        parts = tuple((t.transfer_id, t.decode_agent, t.prefill_agent) for t in ticket.tickets)
        with self._announced_lock:
            self._announced[ticket.transfer_id] = tuple(t for t, _, _ in parts)
        self._rank0().sender_announce(parts)
        if self.size > 1:
            self.driver.post(EXTENSION, RankTransfer.sender_announce.__name__, parts)

    def withdraw_announced(self, transfer_id: str) -> None:
        """`KVSender.withdraw_announced` on every rank, as `announce` reached them."""
        with self._announced_lock:
            tids = self._announced.pop(transfer_id, None)
        if tids is not None:
            self._rank0().sender_withdraw_announced(tids)
            if self.size > 1:
                self.driver.post(EXTENSION, RankTransfer.sender_withdraw_announced.__name__, tids)

    def push(self, transfer_id: str, block_table, num_computed_tokens: int, meta: dict | None = None,
             ready_event=None, group_tables=()) -> int:
        """`KVSender.push` of every part, each on its rank. A `ready_event` cannot cross processes: when one is
        given, each rank gates its parts on an event of its own, recorded after its forward pass; None posts at
        once everywhere. Returns rank 0's count (rank 0 always sends a part: `tp_plan.plan_parts`)."""
        p = self.parts[transfer_id]
        return on_ranks(self.driver, RankTransfer.sender_push, p.tids, list(block_table), num_computed_tokens, meta,
                        [list(t) for t in group_tables], ready_event is not None, gather=False)

    def abort(self, transfer_id: str, message: str = "aborted by prefill") -> bool:
        p = self.parts.get(transfer_id)
        if p is None:
            return False
        self._abort_rest(p, RankTransfer.sender_abort, message)
        return True

    def poll(self) -> SenderEvents:
        out = SenderEvents()
        events = self._gather(RankTransfer.sender_poll) if (self.parts or self._has_work) else None
        if events is None:
            return out
        for tid0, p in self._file(events, {SendDone: "done", SendFailed: "failed"}):
            if p.failed and not p.aborted:
                self._abort_rest(p, RankTransfer.sender_abort, f"part {min(p.failed)} failed")
            if len(p.done) + len(p.failed) < len(p.tids):
                continue
            self._drop(tid0)
            if p.failed:
                out.failed.append(SendFailed(tid0, p.request_id, next(iter(p.failed.values())).error))
            else:
                d = [p.done[i] for i in range(len(p.tids))]
                # the worker serves rank 0's counters: add the other ranks' bytes (their agents moved them)
                self._rank0().sender.metrics.bytes.inc(p.other_ranks_bytes())
                out.completed.append(SendDone(tid0, p.request_id, d[0].num_pushes, sum(x.nbytes for x in d),
                                              max(x.seconds for x in d)))
        return out


class TPReceiver(_TPProxy):
    """Rank 0's `KVReceiver` for all ranks."""

    @property
    def num_waiting(self) -> int:
        return sum(1 for p in self.parts.values() if not p.failed and not p.aborted)

    def expect(self, request_id: str, pages, num_tokens: int, prefill_agent: str, first_page: int = 0,
               group_first_pages: tuple[int, ...] = ()) -> KVTicket | TPTicket:
        """Every rank's tickets (`RankTransfer.receiver_expect`), as one `TPTicket`; a lone part's ticket as
        itself (one rank on both sides: the single-pool wire format)."""
        per_rank = on_ranks(self.driver, RankTransfer.receiver_expect, request_id, list(pages), num_tokens,
                            prefill_agent, first_page, tuple(group_first_pages))
        tickets = tuple(t for rank in per_rank for t in rank)
        remote = tuple(r > 0 for r, rank in enumerate(per_rank) for _ in rank)
        ticket = TPTicket(tickets)
        self._add(ticket.transfer_id, _Parts(tuple(t.transfer_id for t in tickets), request_id, remote))
        return tickets[0] if len(tickets) == 1 and self.size == 1 else ticket

    def abort(self, transfer_id: str, message: str = "aborted by decode") -> bool:
        p = self.parts.get(transfer_id)
        if p is None or p.aborted:
            return False
        self._abort_rest(p, RankTransfer.receiver_abort, message)
        return True

    def withdraw(self, transfer_id: str) -> tuple[int, ...]:
        p = self.parts.get(transfer_id)
        if p is None:
            return ()
        pages = next((r for r in on_ranks(self.driver, RankTransfer.receiver_withdraw, p.tids) if r), ())
        self._drop(transfer_id)
        return pages

    def peer_failed(self, prefill_agent: str, message: str) -> None:
        on_ranks(self.driver, RankTransfer.receiver_peer_failed, prefill_agent, message)

    def poll(self) -> ReceiverEvents:
        out = ReceiverEvents()
        events = self._gather(RankTransfer.receiver_poll) if (self.parts or self._has_work) else None
        if events is None:
            return out
        for tid0, p in self._file(events, {RecvDone: "done", RecvFailed: "failed", PagesReleased: "released"}):
            self._merge(tid0, p, out)
        return out

    def _merge(self, tid0: str, p: _Parts, out: ReceiverEvents) -> None:
        n = len(p.tids)
        if not p.failed and len(p.done) == n:
            self._drop(tid0)
            d = [p.done[i] for i in range(n)]
            self._rank0().receiver.metrics.received_bytes.inc(p.other_ranks_bytes())  # as the sender's
            out.completed.append(RecvDone(tid0, p.request_id, d[0].pages, d[0].meta, d[0].pushes,
                                          sum(x.nbytes for x in d), max(x.wait_s for x in d),
                                          max(x.transfer_s for x in d)))
            return
        if p.failed and not p.reported:
            p.reported = True
            out.failed.append(RecvFailed(tid0, p.request_id, next(iter(p.failed.values())).error))
            self._abort_rest(p, RankTransfer.receiver_abort, f"part {min(p.failed)} failed")
        if p.failed and len(p.done) + len(p.released) == n:
            self._drop(tid0)
            pages = next(iter(p.released.values())).pages if p.released else p.done[min(p.done)].pages
            out.released.append(PagesReleased(tid0, p.request_id, pages, "every rank's part ended"))
