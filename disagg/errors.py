"""How a KV-transfer failure is answered over HTTP, the same way by both roles (see ``docs/worker-api.md``)."""

from __future__ import annotations

from pd_cluster.serving.errors import HTTPError, to_http_error
from pd_cluster.transfer.errors import LayoutMismatchError, StalePeerError, TransferError, TransferTimeoutError


def transfer_http_error(e: BaseException) -> HTTPError:
    """Map a KV-transfer failure to an `HTTPError` (both roles): stale peer or layout mismatch 409,
    timeout 504, any other transfer error 502; anything else as `to_http_error`."""
    if isinstance(e, StalePeerError):
        return HTTPError(409, str(e), None, "stale_peer")
    if isinstance(e, LayoutMismatchError):
        return HTTPError(409, str(e), None, "kv_layout_mismatch")
    if isinstance(e, TransferTimeoutError):
        return HTTPError(504, str(e), None, "kv_transfer_timeout")
    if isinstance(e, TransferError):
        return HTTPError(502, str(e), None, f"kv_transfer_{e.reason}")
    return to_http_error(e)
