"""What the workers need of a transfer agent, a sender and a receiver, as `typing.Protocol`s.

Two implementations of each exist: the single-pool classes (`TransferAgent`,
`KVSender`, `KVReceiver`) and rank 0's proxies under tensor parallelism
(`TPAgent`, `TPSender`, `TPReceiver` in `pd_cluster.transfer.tp`), which drive
every rank's own single-pool object and merge their events. The prefill and
decode workers are written against these protocols only, so either works
unchanged. ``tests/transfer/test_transfer_interfaces.py`` checks both against
them.

All methods run in the worker's engine thread (the step loop) and never block
on the network, except `Agent.connect` (see there) and `Sender.announce` /
`Sender.withdraw_announced`, which the prefill worker's HTTP handler calls.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pd_cluster.transfer.layout import AgentInfo
from pd_cluster.transfer.receiver_events import ReceiverEvents
from pd_cluster.transfer.sender import SenderEvents
from pd_cluster.transfer.ticket import Ticket


@runtime_checkable
class Agent(Protocol):
    """A worker's NIXL endpoint(s) as its peers and its roles see it."""

    name: str
    incarnation: str
    info: AgentInfo

    @property
    def connects_off_thread(self) -> bool:
        """True when `connect` may run on a thread other than the engine thread, concurrently with the
        sender's or receiver's calls (the worker then runs it there, so first contact with a new peer never
        stalls a step)."""
        ...

    def is_connected(self, name: str) -> bool:
        """True when peer agent `name` is loaded (its transfers may start)."""
        ...

    def connect(self, info: AgentInfo) -> None:
        """The handshake: check the layouts and load the peer's metadata. Blocks for the NIXL connection setup.

        Raises:
            LayoutMismatchError: the pages would mean other bytes on the two sides (nothing is loaded).
            ValueError: malformed or self-referencing info.
        """
        ...

    def disconnect(self, name: str) -> None:
        """Forget peer `name` (a superseded incarnation)."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class Sender(Protocol):
    """Prefill side: pushes a request's pages into decode's reserved pages, chunk by chunk."""

    @property
    def has_work(self) -> bool:
        """Keep calling `poll` while True."""
        ...

    @property
    def num_inflight(self) -> int:
        ...

    def add_request(self, ticket: Ticket) -> None:
        """Accept decode's ticket. Raises `StalePeerError`, `PeerNotConnectedError`, `TransferAbortedError`,
        ValueError (see `KVSender.add_request`)."""
        ...

    def announce(self, ticket: Ticket) -> None:
        """A ticket waits for the engine thread: heartbeats name it until `add_request` or `withdraw_announced`.
        The one call besides the heartbeat's that may come from another thread (the HTTP handler's)."""
        ...

    def withdraw_announced(self, transfer_id: str) -> None:
        """The announced ticket will not be added."""
        ...

    def push(self, transfer_id: str, block_table, num_computed_tokens: int, meta: dict | None = None,
             ready_event=None, group_tables=()) -> int:
        """Push the pages `num_computed_tokens` completed; `ready_event` (``query() -> bool``) gates the post;
        `group_tables`: a hybrid pool's block tables of KV groups 1... Returns the pages covered (0: none became
        complete)."""
        ...

    def abort(self, transfer_id: str, message: str = "aborted by prefill") -> bool:
        ...

    def poll(self) -> SenderEvents:
        ...


@runtime_checkable
class Receiver(Protocol):
    """Decode side: hands out tickets for reserved pages and reports completion, failure and page release."""

    @property
    def has_work(self) -> bool:
        """Keep calling `poll` while True."""
        ...

    @property
    def num_waiting(self) -> int:
        ...

    def expect(self, request_id: str, pages, num_tokens: int, prefill_agent: str, first_page: int = 0,
               group_first_pages: tuple[int, ...] = ()) -> Ticket:
        """Register reserved `pages` for a prompt's KV from prompt page `first_page` on (the earlier ones are
        held here already; a hybrid pool's `pages` are slots per `group_first_pages`, `KVTicket`); the ticket
        goes to the prefill worker. Raises `PeerNotConnectedError`, ValueError."""
        ...

    def abort(self, transfer_id: str, message: str = "aborted by decode") -> bool:
        """Give up a transfer; reported failed by the next `poll`, pages released once the sender stopped."""
        ...

    def withdraw(self, transfer_id: str) -> tuple[int, ...]:
        """Drop a ticket the sender never accepted: its pages are free at once (empty if already over).
        Raises ValueError when a push of it arrived (use `abort`)."""
        ...

    def peer_failed(self, prefill_agent: str, message: str) -> None:
        """Fail every transfer from a peer known to be unreachable."""
        ...

    def poll(self) -> ReceiverEvents:
        ...
