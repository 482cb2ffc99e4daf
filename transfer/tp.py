"""KV transfer under tensor parallelism: one agent per rank, rank r of prefill to rank r of decode.

Every rank of a worker holds its own pool (its share of the KV heads) and its
own `TransferAgent`; all ranks use the same page ids (rank 0's allocator).
Rank 0 serves one `AgentInfo` whose ``tp_peers`` lists ranks 1..N-1, and
drives every rank through the proxies here, which keep the single-agent API
of `KVSender` / `KVReceiver`, so the prefill and decode workers use them
unchanged:

- `TPTicket` (in `pd_cluster.transfer.ticket`): the per-rank tickets of one request, sent as one JSON object.
- `TPAgent`, `TPSender`, `TPReceiver`: rank 0's view. Each call runs on every
  rank (`pd_cluster.engine.executor.tp.TPDriver`); `poll` gathers the ranks' events and
  merges them: a transfer is complete when every rank's part is, failed as soon
  as one part fails (the other parts are then aborted), and its pages are
  reusable only once every rank's part has released them or completed.
- `RankTransfer`: what each rank holds, installed on all ranks by the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.layout import AgentInfo
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver import KVReceiver, PagesReleased, ReceiverEvents, RecvDone, RecvFailed
from pd_cluster.transfer.sender import KVSender, SendDone, SenderEvents, SendFailed
from pd_cluster.transfer.ticket import KVTicket, TPTicket

EXTENSION = "kv_transfer"
MIN_POLL_INTERVAL_S = 0.001  # a poll is two collectives; the step loop may ask far more often


class RankTransfer:
    """One rank's agent and sender or receiver (installed on every rank by `install`).

    The methods in ``SIDE_METHODS`` are safe from any thread: rank 0 posts them to the other ranks outside the
    step loop (`pd_cluster.engine.executor.tp.TPDriver.post`).

    Args:
        shard: the rank's `pd_cluster.engine.executor.shard.Shard` (its pool is registered).
        tp: the rank's `TPGroup`.
        role: ``prefill`` or ``decode``.
        config: the `TransferConfig`.
        identity: the model identity for the handshake.
        registry: rank 0's: the worker's Prometheus registry, so its metrics are served; other ranks: None (a
            private one).
    """

    SIDE_METHODS = frozenset({"sender_announce", "sender_withdraw_announced"})

    def __init__(self, shard, tp, role: str, config, identity: str, registry: CollectorRegistry | None = None) -> None:
        self.rank = tp.rank
        self.device = shard.pool.kv.device
        self.agent = TransferAgent(shard.pool, identity, role, config)
        metrics = TransferMetrics(registry or CollectorRegistry())
        self.sender = KVSender(self.agent, metrics) if role == "prefill" else None
        if self.sender is not None:  # this rank's heartbeats: its own process computes its own chunks
            self.sender.start_heartbeat()
        self.receiver = KVReceiver(self.agent, metrics) if role == "decode" else None
        self.peer_names: dict[str, str] = {}  # rank 0's name of a peer worker -> this rank's peer agent

    def info(self) -> AgentInfo:
        return self.agent.info

    def connect(self, info0: AgentInfo) -> None:
        peers = (info0,) + info0.tp_peers
        if len(peers) <= self.rank:
            raise ValueError(f"peer {info0.agent_name} has {len(peers)} TP ranks; this is rank {self.rank}")
        mine = peers[self.rank]
        self.agent.connect(mine)
        self.peer_names[info0.agent_name] = mine.agent_name

    def disconnect(self, name0: str) -> None:
        name = self.peer_names.pop(name0, None)
        if name is not None:
            self.agent.disconnect(name)

    def sender_add(self, tickets: tuple[KVTicket, ...]) -> None:
        self.sender.add_request(tickets[self.rank])

    def sender_announce(self, parts: tuple[tuple[str, str], ...]) -> None:
        """`KVSender.announce_id` for this rank's part: `parts` is every rank's (transfer id, decode agent)."""
        self.sender.announce_id(*parts[self.rank])

    def sender_withdraw_announced(self, tids: tuple[str, ...]) -> None:
        self.sender.withdraw_announced(tids[self.rank])

    def sender_push(self, tids: tuple[str, ...], block_table: list[int], end: int, meta: dict | None,
                    group_tables: list[list[int]], gated: bool) -> int:
        """Push this rank's part; with `gated`, post it once this rank's forward pass has written the pages
        (a CUDA event recorded now, after the step's kernels were queued on this rank's stream)."""
        ready = None
        if gated and self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return self.sender.push(tids[self.rank], block_table, end, meta=meta, ready_event=ready,
                                group_tables=group_tables)

    def sender_abort(self, tids: tuple[str, ...], message: str) -> bool:
        return self.sender.abort(tids[self.rank], message)

    def sender_poll(self) -> tuple[SenderEvents, bool, int]:
        ev = self.sender.poll()
        return ev, self.sender.has_work, self.sender.num_inflight

    def receiver_expect(self, request_id: str, pages: list[int], num_tokens: int, prefill0: str,
                        first_page: int = 0, group_first_pages: tuple[int, ...] = ()) -> KVTicket:
        return self.receiver.expect(request_id, pages, num_tokens, self.peer_names[prefill0], first_page,
                                    group_first_pages)

    def receiver_abort(self, tids: tuple[str, ...], message: str) -> bool:
        return self.receiver.abort(tids[self.rank], message)

    def receiver_withdraw(self, tids: tuple[str, ...]) -> tuple[int, ...]:
        return self.receiver.withdraw(tids[self.rank])

    def receiver_peer_failed(self, prefill0: str, message: str) -> None:
        name = self.peer_names.get(prefill0)
        if name is not None:
            self.receiver.peer_failed(name, message)

    def receiver_poll(self) -> tuple[ReceiverEvents, bool, int]:
        ev = self.receiver.poll()
        return ev, self.receiver.has_work, self.receiver.num_waiting

    def close(self) -> None:
        self.agent.close()


def on_ranks(driver, method: Callable, *args: Any, gather: bool = True) -> Any:
    """Run `RankTransfer` method `method` (the function itself, not its name) on every rank.

    Returns:
        Every rank's result in rank order with `gather`, else rank 0's.

    Raises:
        Exception: the first rank's, as raised there.
    """
    if getattr(method, "__qualname__", "").rpartition(".")[0] != RankTransfer.__qualname__:
        raise TypeError(f"{method!r} is not a RankTransfer method")
    return driver.call("ext", EXTENSION, method.__name__, *args, gather=gather)


def install(driver, role: str, config, identity: str, registry: CollectorRegistry) -> list[AgentInfo]:
    """Create a `RankTransfer` on every rank (rank 0's metrics on `registry`); returns their infos in rank order."""
    driver.call("install", EXTENSION, "pd_cluster.transfer.tp:RankTransfer", role, config, identity, gather=True,
                rank0_kwargs={"registry": registry})
    return on_ranks(driver, RankTransfer.info)


class TPAgent:
    """Rank 0's stand-in for a `TransferAgent` (the handshake runs on every rank)."""

    def __init__(self, driver, infos: list[AgentInfo]) -> None:
        self.driver = driver
        self.name = infos[0].agent_name
        self.incarnation = infos[0].incarnation
        self.info = replace(infos[0], tp_peers=tuple(infos[1:]))
        self._connected: set[str] = set()

    @property
    def connects_off_thread(self) -> bool:
        """False: the handshake is a call on every rank, which must not interleave with a step's calls."""
        return False

    def is_connected(self, name: str) -> bool:
        return name in self._connected

    def connect(self, info: AgentInfo) -> None:
        """Raises: LayoutMismatchError (from any rank) as `TransferAgent.connect`."""
        on_ranks(self.driver, RankTransfer.connect, info)
        self._connected.add(info.agent_name)

    def disconnect(self, name: str) -> None:
        on_ranks(self.driver, RankTransfer.disconnect, name)
        self._connected.discard(name)

    def close(self) -> None:
        on_ranks(self.driver, RankTransfer.close)


@dataclass
class _Parts:
    """Rank 0's record of one transfer's per-rank parts."""

    tids: tuple[str, ...]
    request_id: str
    done: dict[int, object] = field(default_factory=dict)      # rank -> SendDone / RecvDone
    failed: dict[int, object] = field(default_factory=dict)    # rank -> SendFailed / RecvFailed
    released: dict[int, object] = field(default_factory=dict)  # rank -> PagesReleased (decode)
    reported: bool = False
    aborted: bool = False


class _TPProxy:
    def __init__(self, driver) -> None:
        self.driver = driver
        self.size = driver.tp.size
        self.parts: dict[str, _Parts] = {}
        self._has_work = False
        self._last_poll = 0.0

    @property
    def has_work(self) -> bool:
        return bool(self.parts) or self._has_work

    def _gather(self, method: Callable) -> list | None:
        now = time.monotonic()
        if now - self._last_poll < MIN_POLL_INTERVAL_S:
            return None
        self._last_poll = now
        results = on_ranks(self.driver, method)
        self._has_work = any(r[1] for r in results)
        return [r[0] for r in results]

    def _rank0(self) -> RankTransfer:
        """Rank 0's own `RankTransfer` (its metrics are the ones the worker serves)."""
        return self.driver.local.extensions[EXTENSION]

    def _abort_rest(self, p: _Parts, method: Callable, message: str) -> None:
        if not p.aborted:
            p.aborted = True
            on_ranks(self.driver, method, p.tids, message)


class TPSender(_TPProxy):
    """Rank 0's `KVSender` for all ranks."""

    def __init__(self, driver) -> None:
        super().__init__(driver)
        self._announced: dict[str, tuple[str, ...]] = {}  # announced, not yet added: transfer id -> ranks' ids
        self._announced_lock = threading.Lock()  # the HTTP handler announces; the engine thread adds

    @property
    def num_inflight(self) -> int:
        return len(self.parts)

    def add_request(self, ticket: TPTicket) -> None:
        if not isinstance(ticket, TPTicket) or len(ticket.tickets) != self.size:
            raise ValueError(f"a TP-{self.size} prefill worker needs one ticket per rank")
        on_ranks(self.driver, RankTransfer.sender_add, ticket.tickets)  # raises: the caller withdraws the ticket
        with self._announced_lock:
            self._announced.pop(ticket.transfer_id, None)
        self.parts[ticket.transfer_id] = _Parts(tuple(t.transfer_id for t in ticket.tickets), ticket.request_id)

    def announce(self, ticket: TPTicket) -> None:
        """`KVSender.announce` on every rank, from the caller's thread (the HTTP handler's) while the engine
        thread may be inside a long step: rank 0's at once, the others' through the driver's side channel
        (`TPDriver.post`), so every rank's heartbeats name its part of the ticket while it waits."""
        if not isinstance(ticket, TPTicket) or len(ticket.tickets) != self.size:
            raise ValueError(f"a TP-{self.size} prefill worker needs one ticket per rank")
        parts = tuple((t.transfer_id, t.decode_agent) for t in ticket.tickets)
        with self._announced_lock:
            self._announced[ticket.transfer_id] = tuple(t for t, _ in parts)
        self._rank0().sender_announce(parts)
        self.driver.post(EXTENSION, RankTransfer.sender_announce.__name__, parts)

    def withdraw_announced(self, transfer_id: str) -> None:
        """`KVSender.withdraw_announced` on every rank, as `announce` reached them."""
        with self._announced_lock:
            tids = self._announced.pop(transfer_id, None)
        if tids is not None:
            self._rank0().sender_withdraw_announced(tids)
            self.driver.post(EXTENSION, RankTransfer.sender_withdraw_announced.__name__, tids)

    def push(self, transfer_id: str, block_table, num_computed_tokens: int, meta: dict | None = None,
             ready_event=None, group_tables=()) -> int:
        """`KVSender.push` on every rank. A `ready_event` cannot cross processes: when one is given, each rank
        gates its part on an event of its own, recorded after its forward pass; None posts at once everywhere."""
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
        by_rank_tid = {tid: (tid0, r) for tid0, p in self.parts.items() for r, tid in enumerate(p.tids)}
        for rank, ev in enumerate(events):
            for item in ev.completed + ev.failed:
                tid0, r = by_rank_tid.get(item.transfer_id, (None, None))
                if tid0 is not None:
                    (self.parts[tid0].done if isinstance(item, SendDone) else self.parts[tid0].failed)[r] = item
        for tid0, p in list(self.parts.items()):
            if p.failed and not p.aborted:
                self._abort_rest(p, RankTransfer.sender_abort, f"rank {min(p.failed)} failed")
            if len(p.done) + len(p.failed) < self.size:
                continue
            del self.parts[tid0]
            if p.failed:
                out.failed.append(SendFailed(tid0, p.request_id, next(iter(p.failed.values())).error))
            else:
                d = [p.done[r] for r in range(self.size)]
                # the worker serves rank 0's counters: add the other ranks' bytes (their agents moved them)
                self._rank0().sender.metrics.bytes.inc(sum(x.nbytes for x in d[1:]))
                out.completed.append(SendDone(tid0, p.request_id, d[0].num_pushes, sum(x.nbytes for x in d),
                                              max(x.seconds for x in d)))
        return out


class TPReceiver(_TPProxy):
    """Rank 0's `KVReceiver` for all ranks."""

    @property
    def num_waiting(self) -> int:
        return sum(1 for p in self.parts.values() if not p.failed and not p.aborted)

    def expect(self, request_id: str, pages, num_tokens: int, prefill_agent: str, first_page: int = 0,
               group_first_pages: tuple[int, ...] = ()) -> TPTicket:
        tickets = on_ranks(self.driver, RankTransfer.receiver_expect, request_id, list(pages), num_tokens,
                           prefill_agent, first_page, tuple(group_first_pages))
        ticket = TPTicket(tuple(tickets))
        self.parts[ticket.transfer_id] = _Parts(tuple(t.transfer_id for t in tickets), request_id)
        return ticket

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
        pages = on_ranks(self.driver, RankTransfer.receiver_withdraw, p.tids)[0]
        del self.parts[transfer_id]
        return pages

    def peer_failed(self, prefill_agent: str, message: str) -> None:
        on_ranks(self.driver, RankTransfer.receiver_peer_failed, prefill_agent, message)

    def poll(self) -> ReceiverEvents:
        out = ReceiverEvents()
        events = self._gather(RankTransfer.receiver_poll) if (self.parts or self._has_work) else None
        if events is None:
            return out
        by_rank_tid = {tid: (tid0, r) for tid0, p in self.parts.items() for r, tid in enumerate(p.tids)}
        for ev in events:
            for item in ev.completed + ev.failed + ev.released:
                tid0, r = by_rank_tid.get(item.transfer_id, (None, None))
                if tid0 is None:
                    continue
                p = self.parts[tid0]
                {RecvDone: p.done, RecvFailed: p.failed, PagesReleased: p.released}[type(item)][r] = item
        for tid0, p in list(self.parts.items()):
            self._merge(tid0, p, out)
        return out

    def _merge(self, tid0: str, p: _Parts, out: ReceiverEvents) -> None:
        if not p.failed and len(p.done) == self.size:
            del self.parts[tid0]
            d = [p.done[r] for r in range(self.size)]
            self._rank0().receiver.metrics.received_bytes.inc(sum(x.nbytes for x in d[1:]))  # as the sender's
            out.completed.append(RecvDone(tid0, p.request_id, d[0].pages, d[0].meta, d[0].pushes,
                                          sum(x.nbytes for x in d), max(x.wait_s for x in d),
                                          max(x.transfer_s for x in d)))
            return
        if p.failed and not p.reported:
            p.reported = True
            out.failed.append(RecvFailed(tid0, p.request_id, next(iter(p.failed.values())).error))
            self._abort_rest(p, RankTransfer.receiver_abort, f"rank {min(p.failed)} failed")
        if p.failed and len(p.done) + len(p.released) == self.size:
            del self.parts[tid0]
            pages = next(iter(p.released.values())).pages if p.released else p.done[min(p.done)].pages
            out.released.append(PagesReleased(tid0, p.request_id, pages, "every rank's part ended"))
