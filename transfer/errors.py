"""Typed errors of the KV transfer path.

Every failure a caller can see is a `TransferError` with a short ``reason``
(the label of ``pd:kv_transfer_failed_total``) and a ``retriable`` flag that
maps onto the worker API's status codes: a retriable failure is a 502 (peer
died, transfer failed) or a 504 (deadline), a non-retriable one is a
configuration problem that another attempt on the same pair cannot fix.
"""

from __future__ import annotations

from dataclasses import dataclass


class TransferError(RuntimeError):
    """Base class. ``reason`` is the metric label; ``retriable`` says whether another pair may succeed."""

    reason: str = "error"
    retriable: bool = True
    http_status: int = 502

    def __init__(self, message: str, *, transfer_id: str | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.transfer_id = transfer_id
        self.peer = peer

    def __reduce__(self):
        # Subclasses take keyword-only arguments, which default exception pickling cannot replay; errors
        # cross process boundaries under tensor parallelism (a rank's events go to rank 0).
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> TransferError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


@dataclass(frozen=True)
class Mismatch:
    """One field on which two KV layouts disagree.

    Attributes:
        field: the layout field (``page_size``, ``kv_cache_dtype``, ...).
        local, remote: this worker's value and the peer's.
        convertible: True when the transfer converts between the two (TP size and
            rank: KV heads split or merged, `pd_cluster.transfer.tp_plan`); False
            when the pages cannot mean the same thing on both sides.
    """

    field: str
    local: object
    remote: object
    convertible: bool

    def __str__(self) -> str:
        kind = "converted" if self.convertible else "fatal"
        return f"{self.field}: local={self.local!r} remote={self.remote!r} ({kind})"


class LayoutMismatchError(TransferError):
    """The peer's KV pool cannot receive (or send) this pool's pages byte for byte.

    Raised at the handshake, before any transfer: no page is written.
    """

    reason = "layout_mismatch"
    retriable = False
    http_status = 502

    def __init__(self, local_name: str, remote_name: str, mismatches: list[Mismatch]) -> None:
        detail = "; ".join(str(m) for m in mismatches)
        super().__init__(
            f"KV layout mismatch between local agent {local_name} and peer {remote_name}: {detail}. "
            "No KV was transferred.", peer=remote_name)
        self.mismatches = mismatches
        self.local_name = local_name
        self.remote_name = remote_name

    @property
    def fields(self) -> list[str]:
        return [m.field for m in self.mismatches]


class StalePeerError(TransferError):
    """Metadata names an agent incarnation that is not the live one (the peer restarted).

    The caller refreshes the peer's metadata (`transfer.http.PeerDirectory.refresh`) and retries.
    """

    reason = "stale_peer"


class PeerNotConnectedError(TransferError):
    """No metadata of this peer agent is loaded; fetch and `connect` it first."""

    reason = "not_connected"


class PeerDiedError(TransferError):
    """The peer's process is gone: NIXL reported the remote endpoint disconnected."""

    reason = "peer_died"


class TransferTimeoutError(TransferError):
    """A deadline passed: decode's ``--kv-transfer-timeout``, or a push's own timeout on the sender."""

    reason = "timeout"
    http_status = 504


class TransferAbortedError(TransferError):
    """The transfer was aborted by this side or by the peer (``side`` says which)."""

    reason = "aborted"

    def __init__(self, message: str, *, side: str, transfer_id: str | None = None, peer: str | None = None) -> None:
        super().__init__(message, transfer_id=transfer_id, peer=peer)
        self.side = side


class NixlTransferError(TransferError):
    """NIXL returned an error status for a posted transfer (or refused to create it)."""

    reason = "nixl_error"


class ProtocolError(TransferError):
    """A peer sent a notification that contradicts the transfer's plan (pages, push indices)."""

    reason = "protocol"
    retriable = False


class MetadataFetchError(TransferError):
    """The peer's metadata endpoint could not be reached or answered garbage.

    ``refused``: the connection was refused (nothing listens: the peer is gone or restarting; a fact, not
    retried). ``slow``: the fetch timed out or the peer answered 503 (starting, busy): slowness, which the
    caller retries within its deadline (`pd_cluster.common.deadline`).
    """

    reason = "metadata_unreachable"

    def __init__(self, message: str, *, refused: bool = False, slow: bool = False, transfer_id: str | None = None,
                 peer: str | None = None) -> None:
        super().__init__(message, transfer_id=transfer_id, peer=peer)
        self.refused = refused
        self.slow = slow
