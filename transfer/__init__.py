"""KV cache transfer between a prefill worker's pool and a decode worker's pool over NIXL.

Pieces (see ``docs/transfer.md``):

* `TransferAgent` (`transfer.agent`): one NIXL agent per worker / TP rank, the
  whole pool registered once; serves its `AgentInfo` (metadata + layout).
* `PeerDirectory`, `make_router` (`transfer.http`): the HTTP side of the handshake.
* `check_compatible` (`transfer.layout`): refuses peers whose pages mean other bytes.
* `KVReceiver` (decode) makes a `KVTicket` for reserved pages and reports
  completion, failure and page release from a non-blocking `poll`.
* `KVSender` (prefill) pushes each chunk's pages with a WRITE as soon as they are
  written; the last push carries the completion notification.
* `TransferMetrics`: the ``pd:kv_transfer_*`` metrics on a caller's registry.

Heavy imports (NIXL, torch) happen only in `transfer.agent`; this package root
imports nothing heavy.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "TransferConfig": "transfer.config",
    "TransferAgent": "transfer.agent",
    "AgentInfo": "transfer.layout",
    "check_compatible": "transfer.layout",
    "KVTicket": "transfer.ticket",
    "KVSender": "transfer.sender",
    "KVReceiver": "transfer.receiver",
    "TransferMetrics": "transfer.metrics",
    "PeerDirectory": "transfer.http",
    "make_router": "transfer.http",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'transfer' has no attribute {name!r}")
