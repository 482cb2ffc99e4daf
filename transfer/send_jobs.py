"""The prefill side's record of its transfers: the events `KVSender.poll` reports, and one transfer's pushes.

`SendDone` / `SendFailed` are what the worker acts on (free the request's prefill pages); `SendJob` is one
accepted ticket with its pushes and clocks, owned by the `KVSender` (``transfer/sender.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pd_cluster.transfer import protocol
from pd_cluster.transfer.errors import TransferError
from pd_cluster.transfer.ticket import KVTicket


@dataclass(frozen=True)
class SendDone:
    """Every push of a transfer completed; the request's prefill pages may be freed."""

    transfer_id: str
    request_id: str
    num_pushes: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class SendFailed:
    """A transfer stopped with `error`; no handle of it is left, its prefill pages may be freed."""

    transfer_id: str
    request_id: str
    error: TransferError


@dataclass
class SenderEvents:
    completed: list[SendDone] = field(default_factory=list)
    failed: list[SendFailed] = field(default_factory=list)


@dataclass
class SendPush:
    """One push: its notification, both sides' descriptors, the CUDA event gating it, its NIXL handle."""

    msg: protocol.Push
    local: np.ndarray
    remote: np.ndarray
    ready: object | None
    handle: object | None = None
    posted_at: float = 0.0  # the sender's clock, for the push timeout
    started: float = 0.0  # perf_counter before the post, for the latency and speed metrics
    done: bool = False


@dataclass
class SendJob:
    """One accepted ticket: its pushes, progress and clocks."""

    ticket: KVTicket
    started: float
    last_progress: float
    pushes: list[SendPush] = field(default_factory=list)
    sent_pages: int = 0  # prompt pages pushed or held by decode (starts at the ticket's first_page)
    last_issued: bool = False
    nbytes: int = 0
    error: TransferError | None = None
    ack: bool = False
    vouched: float = 0.0  # when the last heartbeat naming it was sent (the clock just before the send)

    @property
    def peer(self) -> str:
        return self.ticket.decode_agent

    @property
    def live_since(self) -> float:
        """The later of its last progress and its last heartbeat: what decode's deadline counts from, or later."""
        return max(self.last_progress, self.vouched)
