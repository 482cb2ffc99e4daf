"""The notifications the two sides exchange over NIXL, and their wire form.

Data moves by one-sided WRITE; control rides on NIXL notifications (UCX
active messages, ordered per connection):

* `Push` (sender -> receiver, sent once NIXL reports the push's WRITE
  complete, i.e. flushed into the receiver's memory, so it always follows its
  data): transfer id, push index, which of the request's pages it covered,
  its bytes; the last push also carries the number of pushes and a small
  payload (the first token).
* `Stopped` (sender -> receiver, standalone): the sender has released every
  handle of the transfer; nothing more will be written, the pages are the
  receiver's again. ``ack`` says it answers a `Cancel`.
* `Cancel` (receiver -> sender, standalone): stop this transfer.
* `Ack` (receiver -> sender): every push arrived (``what="done"``), or the
  `Stopped` arrived (``what="stopped"``). Until then the sender keeps
  polling, which is what moves its last message out: measured here, a
  message to a peer whose connection is still being set up leaves only
  while the sender keeps progressing.
* `Ping` (either way, standalone): a liveness probe; sending it fails fast
  with a disconnect error when the peer's process is gone.
* `Alive` (sender -> receiver, standalone): the heartbeat. The sender's
  process is running and these transfers are its work (a chunk computing, or
  the request queued): the receiver's deadline restarts for each of them. It
  comes from a thread of its own, so a chunk that computes longer than the
  deadline does not fail its transfer, while a frozen or dead process sends
  none (`KVSender.heartbeat`).

Wire form: ``b"pdkv1"`` followed by compact JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAGIC = b"pdkv1"


@dataclass(frozen=True)
class Push:
    """One WRITE of a transfer.

    Attributes:
        transfer_id: the ticket's transfer id.
        index: 0, 1, ... in the order the sender issued the pushes.
        page_start: position of the first page in the request's page list.
        num_pages: pages written by this push.
        nbytes: bytes written by this push.
        total: number of pushes of the transfer on the last push, else 0.
        meta: on the last push, the payload for decode (e.g. ``first_token_id``).
    """

    transfer_id: str
    index: int
    page_start: int
    num_pages: int
    nbytes: int
    total: int = 0
    meta: dict | None = field(default=None, compare=False)

    @property
    def is_last(self) -> bool:
        return self.total > 0


@dataclass(frozen=True)
class Stopped:
    """The sender stopped the transfer and holds no handle of it any more."""

    transfer_id: str
    reason: str
    message: str
    ack: bool = False


@dataclass(frozen=True)
class Cancel:
    """The receiver asks the sender to stop a transfer."""

    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Ack:
    """The receiver got the transfer's last message (``what``: ``done`` or ``stopped``)."""

    transfer_id: str
    what: str


@dataclass(frozen=True)
class Ping:
    """A liveness probe; carries nothing."""


@dataclass(frozen=True)
class Alive:
    """The heartbeat: the sender is alive and working on these transfers (ids of the receiver's tickets)."""

    transfer_ids: tuple[str, ...]


Message = Push | Stopped | Cancel | Ack | Ping | Alive


def encode(msg: Message) -> bytes:
    """The wire bytes of `msg`."""
    if isinstance(msg, Push):
        d = {"t": "push", "x": msg.transfer_id, "i": msg.index, "s": msg.page_start, "n": msg.num_pages,
             "b": msg.nbytes}
        if msg.total:
            d["total"] = msg.total
            d["m"] = msg.meta or {}
    elif isinstance(msg, Stopped):
        d = {"t": "stopped", "x": msg.transfer_id, "r": msg.reason, "msg": msg.message, "ack": msg.ack}
    elif isinstance(msg, Cancel):
        d = {"t": "cancel", "x": msg.transfer_id, "r": msg.reason}
    elif isinstance(msg, Ack):
        d = {"t": "ack", "x": msg.transfer_id, "w": msg.what}
    elif isinstance(msg, Ping):
        d = {"t": "ping"}
    elif isinstance(msg, Alive):
        d = {"t": "alive", "x": list(msg.transfer_ids)}
    else:
        raise TypeError(f"not a transfer message: {msg!r}")
    return MAGIC + json.dumps(d, separators=(",", ":")).encode()


def decode(raw: bytes) -> Message:
    """Parse wire bytes.

    Raises:
        ValueError: not a message of this protocol, or malformed.
    """
    if not raw.startswith(MAGIC):
        raise ValueError(f"not a pd-cluster KV transfer message: {raw[:32]!r}")
    try:
        d = json.loads(raw[len(MAGIC):])
        kind = d["t"]
        if kind == "push":
            return Push(str(d["x"]), int(d["i"]), int(d["s"]), int(d["n"]), int(d["b"]),
                        int(d.get("total", 0)), d.get("m"))
        if kind == "stopped":
            return Stopped(str(d["x"]), str(d["r"]), str(d["msg"]), bool(d["ack"]))
        if kind == "cancel":
            return Cancel(str(d["x"]), str(d["r"]))
        if kind == "ack":
            return Ack(str(d["x"]), str(d["w"]))
        if kind == "ping":
            return Ping()
        if kind == "alive":
            ids = d["x"]
            if not isinstance(ids, list):
                raise TypeError(f"alive: transfer ids must be a list, got {type(ids).__name__}")
            return Alive(tuple(str(x) for x in ids))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed KV transfer message {raw[:64]!r}: {e!r}") from e
    raise ValueError(f"unknown KV transfer message kind {kind!r}")
