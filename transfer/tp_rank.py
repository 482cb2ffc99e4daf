"""One TP rank's side of KV transfer: its agent, its sender or receiver, and its parts with each peer worker.

Rank 0 drives every rank's `RankTransfer` through `on_ranks` (`pd_cluster.transfer.tp`); a TP-1 worker drives its
only one in-process (`pd_cluster.transfer.factory.LocalDriver`). Which ranks of two workers exchange which KV heads
is `pd_cluster.transfer.tp_plan`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.errors import PeerNotConnectedError
from pd_cluster.transfer.layout import AgentInfo, check_compatible
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver import KVReceiver
from pd_cluster.transfer.receiver_events import ReceiverEvents
from pd_cluster.transfer.sender import KVSender, SenderEvents
from pd_cluster.transfer.ticket import KVTicket
from pd_cluster.transfer.tp_plan import Part, describe, plan_parts

EXTENSION = "kv_transfer"


class RankTransfer:
    """One rank's agent and sender or receiver (installed on every rank by `install`).

    The methods in ``SIDE_METHODS`` are safe from any thread: rank 0 posts them to the other ranks outside the
    step loop (`pd_cluster.engine.executor.tp.TPDriver.post`). Calls that name a transfer pass every part's id
    (`TPTicket`); each rank acts on its own parts only.

    Args:
        shard: the rank's `pd_cluster.engine.executor.shard.Shard` (its pool is registered).
        tp: the rank's `TPGroup`.
        role: ``prefill`` or ``decode``.
        config: the `TransferConfig`.
        identity: the model identity for the handshake.
        speculative: the worker's speculative decoding for the handshake (`AgentInfo.speculative`).
        registry: rank 0's: the worker's Prometheus registry, so its metrics are served; other ranks: None (a
            private one).
    """

    SIDE_METHODS = frozenset({"sender_announce", "sender_withdraw_announced"})

    def __init__(self, shard, tp, role: str, config, identity: str, speculative: dict | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.rank, self.size, self.role = tp.rank, tp.size, role
        self.device = shard.pool.kv.device
        self.agent = TransferAgent(shard.pool, identity, role, config, speculative)
        metrics = TransferMetrics(registry or CollectorRegistry())
        self.sender = KVSender(self.agent, metrics) if role == "prefill" else None
        if self.sender is not None:  # this rank's heartbeats: its own process computes its own chunks
            self.sender.start_heartbeat()
        self.receiver = KVReceiver(self.agent, metrics) if role == "decode" else None
        # rank 0's name of a peer worker -> this rank's parts with it: (the peer rank's agent, the part)
        self.peer_parts: dict[str, list[tuple[str, Part]]] = {}
        self._own: set[str] = set()  # this rank's sending parts in flight

    def info(self) -> AgentInfo:
        return self.agent.info

    def connect(self, info0: AgentInfo) -> str:
        """Meet the peer worker whose rank 0 is `info0`: connect to each of its ranks this rank exchanges KV with
        (`pd_cluster.transfer.tp_plan.plan_parts`).

        Returns:
            What the transfer converts (`tp_plan.describe`).

        Raises:
            LayoutMismatchError: the layouts cannot be converted (both sides named).
            ValueError: the peer's ranks contradict its TP size.
        """
        peers = (info0,) + info0.tp_peers
        lay = self.agent.info.layout
        remote_tp = int(info0.layout.get("tp_size", 1))
        if len(peers) != remote_tp:
            raise ValueError(f"peer {info0.agent_name} says TP {remote_tp} but lists {len(peers)} ranks")
        if remote_tp != self.size:
            check_compatible(self.agent.info, info0)  # refused here, before planning, naming both sides
        sending = self.role == "prefill"
        p_tp, d_tp = (self.size, remote_tp) if sending else (remote_tp, self.size)
        parts = plan_parts(str(lay.get("kv_format", "mha")), int(lay["num_kv_heads"]) * self.size, p_tp, d_tp)
        mine = [(part, peers[part.decode_rank if sending else part.prefill_rank]) for part in parts
                if (part.prefill_rank if sending else part.decode_rank) == self.rank]
        for _, peer in mine:
            self.agent.connect(peer)
        self.peer_parts[info0.agent_name] = [(peer.agent_name, part) for part, peer in mine]
        return describe(parts, str(lay.get("kv_format", "mha")), p_tp, d_tp)

    def disconnect(self, name0: str) -> None:
        for name, _ in self.peer_parts.pop(name0, ()):
            self.agent.disconnect(name)

    def sender_add(self, tickets: tuple[KVTicket, ...]) -> None:
        for t in tickets:
            if t.prefill_agent == self.agent.name:
                self.sender.add_request(t)
                self._own.add(t.transfer_id)

    def sender_announce(self, parts: tuple[tuple[str, str, str], ...]) -> None:
        """`KVSender.announce_id` for this rank's parts: `parts` is every part's (transfer id, decode agent,
        prefill agent)."""
        for tid, decode_agent, prefill_agent in parts:
            if prefill_agent == self.agent.name:
                self.sender.announce_id(tid, decode_agent)

    def sender_withdraw_announced(self, tids: tuple[str, ...]) -> None:
        for tid in tids:
            self.sender.withdraw_announced(tid)

    def sender_push(self, tids: tuple[str, ...], block_table: list[int], end: int, meta: dict | None,
                    group_tables: list[list[int]], gated: bool) -> int:
        """Push this rank's parts; with `gated`, post them once this rank's forward pass has written the pages
        (a CUDA event recorded now, after the step's kernels were queued on this rank's stream)."""
        ready = None
        if gated and self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        covered = 0
        for tid in tids:
            if tid in self._own:
                covered = max(covered, self.sender.push(tid, block_table, end, meta=meta, ready_event=ready,
                                                        group_tables=group_tables))
        return covered

    def sender_abort(self, tids: tuple[str, ...], message: str) -> bool:
        return any([self.sender.abort(tid, message) for tid in tids])

    def sender_poll(self) -> tuple[SenderEvents, bool, int]:
        ev = self.sender.poll()
        for item in ev.completed + ev.failed:
            self._own.discard(item.transfer_id)
        return ev, self.sender.has_work, self.sender.num_inflight

    def receiver_expect(self, request_id: str, pages: list[int], num_tokens: int, prefill0: str,
                        first_page: int = 0, group_first_pages: tuple[int, ...] = ()) -> list[KVTicket]:
        """One ticket per part this rank receives from the peer worker whose rank 0 is `prefill0`.

        Raises:
            PeerNotConnectedError: that worker was never met (`connect`).
        """
        parts = self.peer_parts.get(prefill0)
        if parts is None:
            raise PeerNotConnectedError(f"no metadata loaded for peer agent {prefill0}; fetch it and connect first",
                                        peer=prefill0)
        return [self.receiver.expect_heads(request_id, pages, num_tokens, name, first_page, group_first_pages,
                                     tuple((s.src_head, s.dst_head, s.num_heads) for s in part.slices))
                for name, part in parts]

    def receiver_abort(self, tids: tuple[str, ...], message: str) -> bool:
        return any([self.receiver.abort(tid, message) for tid in tids])

    def receiver_withdraw(self, tids: tuple[str, ...]) -> tuple[int, ...]:
        pages: tuple[int, ...] = ()
        for tid in tids:
            pages = self.receiver.withdraw(tid) or pages
        return pages

    def receiver_peer_failed(self, prefill0: str, message: str) -> None:
        for name, _ in self.peer_parts.get(prefill0, ()):
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


def install(driver, role: str, config, identity: str, registry: CollectorRegistry,
            speculative: dict | None = None) -> list[AgentInfo]:
    """Create a `RankTransfer` on every rank (rank 0's metrics on `registry`); returns their infos in rank order."""
    driver.call("install", EXTENSION, "pd_cluster.transfer.tp_rank:RankTransfer", role, config, identity, speculative,
                gather=True, rank0_kwargs={"registry": registry})
    return on_ranks(driver, RankTransfer.info)
