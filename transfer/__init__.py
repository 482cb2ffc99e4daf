"""KV cache transfer between a prefill worker's pool and a decode worker's pool over NIXL.

Pieces (see ``docs/transfer.md``):

* `TransferAgent` (`pd_cluster.transfer.agent`): one NIXL agent per worker / TP rank, the
  whole pool registered once; serves its `AgentInfo` (metadata + layout).
* `PeerDirectory`, `make_router` (`pd_cluster.transfer.http`): the HTTP side of the handshake.
* `check_compatible` (`pd_cluster.transfer.layout`): refuses peers whose pages mean other bytes.
* `KVReceiver` (decode) makes a `KVTicket` for reserved pages and reports
  completion, failure and page release from a non-blocking `poll`.
* `KVSender` (prefill) pushes each chunk's pages with a WRITE as soon as they are
  written; the last push carries the completion notification.
* `TransferMetrics`: the ``pd:kv_transfer_*`` metrics on a caller's registry.
* `Agent`, `Sender`, `Receiver` (`pd_cluster.transfer.interfaces`): the protocols the workers are typed
  with, implemented by the classes above and by the TP proxies (`pd_cluster.transfer.tp`);
  `make_worker_transfer` (`pd_cluster.transfer.factory`) builds a worker's pair.

The ``/prefill`` call that carries a ticket between the two roles is theirs, not the transfer's: it is in
`pd_cluster.disagg.prefill_api`. This package imports no other package of ours but `pd_cluster.common`.

Heavy imports (NIXL, torch) happen only in `pd_cluster.transfer.agent`; this package root
imports nothing heavy.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "TransferConfig": "pd_cluster.transfer.config",
    "TransferAgent": "pd_cluster.transfer.agent",
    "AgentInfo": "pd_cluster.transfer.layout",
    "check_compatible": "pd_cluster.transfer.layout",
    "KVTicket": "pd_cluster.transfer.ticket",
    "TPTicket": "pd_cluster.transfer.ticket",
    "Agent": "pd_cluster.transfer.interfaces",
    "Sender": "pd_cluster.transfer.interfaces",
    "Receiver": "pd_cluster.transfer.interfaces",
    "make_worker_transfer": "pd_cluster.transfer.factory",
    "KVSender": "pd_cluster.transfer.sender",
    "KVReceiver": "pd_cluster.transfer.receiver",
    "TransferMetrics": "pd_cluster.transfer.metrics",
    "PeerDirectory": "pd_cluster.transfer.http",
    "make_router": "pd_cluster.transfer.http",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'transfer' has no attribute {name!r}")
