"""What a decode worker's `KVReceiver.poll` reports: transfers completed, failed, and pages safe to reuse."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.transfer import protocol
from pd_cluster.transfer.errors import TransferError


@dataclass(frozen=True)
class RecvDone:
    """All pushes of a transfer arrived; the pages hold the prompt's KV.

    Attributes:
        meta: the last push's payload (e.g. ``first_token_id``).
        pushes: every push's notification, by index.
        wait_s: from `expect` to completion.
        transfer_s: from the first push's arrival to completion.
    """

    transfer_id: str
    request_id: str
    pages: tuple[int, ...]
    meta: dict
    pushes: tuple[protocol.Push, ...]
    nbytes: int
    wait_s: float
    transfer_s: float


@dataclass(frozen=True)
class RecvFailed:
    """The transfer failed; the request is over. Its pages come back in a `PagesReleased`."""

    transfer_id: str
    request_id: str
    error: TransferError


@dataclass(frozen=True)
class PagesReleased:
    """These pages of a failed transfer are safe to reuse: free them."""

    transfer_id: str
    request_id: str
    pages: tuple[int, ...]
    why: str


@dataclass
class ReceiverEvents:
    completed: list[RecvDone] = field(default_factory=list)
    failed: list[RecvFailed] = field(default_factory=list)
    released: list[PagesReleased] = field(default_factory=list)
