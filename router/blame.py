"""Which worker a failed attempt is blamed on (and so whose circuit breaker counts it).

A decode worker answers 502/504 for failures of its pair before the first
token (``docs/worker-api.md``). The worker says which peer failed, first by
the response header ``X-PD-Failed-Peer`` (``prefill``, ``decode`` or
``none``), else by the OpenAI error body's ``code``:

- the prefill's fault: ``prefill_unreachable`` (its connection refused or
  reset: it is gone), ``stale_peer``, ``kv_transfer_peer_died``,
  ``kv_transfer_stale_peer``, ``kv_layout_mismatch``,
  ``kv_transfer_layout_mismatch``;
- the decode's own fault: ``kv_transfer_not_connected``, ``kv_transfer_protocol``,
  ``internal_error``;
- nobody's (overload): ``overloaded`` and every 503;
- ambiguous: ``kv_transfer_timeout``, ``kv_transfer_nixl_error``,
  ``kv_transfer_aborted``, ``kv_transfer_metadata_unreachable`` and
  ``prefill_timeout`` (a peer that stayed slow past the request's deadline:
  the workers retry slowness within it, and either side may be the slow one)
  and unknown codes. A late transfer is as likely a
  stalled decode as a stalled prefill (a decode frozen for a minute answers
  ``kv_transfer_timeout`` for every request it held once it runs again), so no
  breaker counts it; both workers get an immediate health check instead,
  which finds the one that is really down.

A mixed worker has no peer: everything it answers is its own.

During a migration (an attempt that continues a stream whose first decode failed), a decode worker's claim
that its prefill failed (header or code) is not charged either: the failing decode of the first attempt can
break the prefill's side of a transfer (a frozen decode holds its connections), and in a 1P cluster an open
prefill breaker blocks every request for its timeout. Both workers get an immediate health check instead, which
finds a prefill that is really down.
"""

from __future__ import annotations

import json

from pd_cluster.router.config import Role

FAILED_PEER_HEADER = "x-pd-failed-peer"

PREFILL_CODES = frozenset({
    "prefill_unreachable", "stale_peer", "kv_transfer_peer_died", "kv_transfer_stale_peer", "kv_layout_mismatch",
    "kv_transfer_layout_mismatch"})
DECODE_CODES = frozenset({"kv_transfer_not_connected", "kv_transfer_protocol", "internal_error"})
OVERLOAD_CODES = frozenset({"overloaded"})


class Blame:
    """Outcome of :func:`blame_status`: ``role`` counted, or ``None``; ``ambiguous`` probes both."""

    __slots__ = ("role", "ambiguous", "code")

    def __init__(self, role: Role | None, ambiguous: bool = False, code: str | None = None) -> None:
        self.role = role
        self.ambiguous = ambiguous
        self.code = code


def _error_field(body: bytes | None, name: str) -> str | None:
    if not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    err = data.get("error") if isinstance(data, dict) else None
    value = err.get(name) if isinstance(err, dict) else None
    return None if value is None else str(value)


def error_code(body: bytes | None) -> str | None:
    """The ``error.code`` of an OpenAI error body, as a string (``None`` when absent)."""
    return _error_field(body, "code")


def error_param(body: bytes | None) -> str | None:
    """The ``error.param`` of an OpenAI error body (``None`` when absent)."""
    return _error_field(body, "param")


def blame_status(status: int, body: bytes | None, failed_peer: str | None, pd: bool,
                 migrating: bool = False) -> Blame:
    """Blame for a retriable status (502/503/504) answered by the decode (or mixed) worker.

    ``failed_peer``: the ``X-PD-Failed-Peer`` header, if any. ``pd``: the
    attempt had a prefill worker (False for a mixed worker). ``migrating``: the
    attempt continues a stream that already started (module docstring: a
    prefill blamed then is only probed).
    """
    code = error_code(body)
    if status == 503 or code in OVERLOAD_CODES:
        return Blame(None, code=code)
    if not pd:
        return Blame(Role.DECODE, code=code)
    peer = (failed_peer or "").strip().lower()
    if migrating and (peer == "prefill" or (not peer and code in PREFILL_CODES)):
        return Blame(None, ambiguous=True, code=code)
    if peer in ("prefill", "decode"):
        return Blame(Role(peer), code=code)
    if peer == "none":
        return Blame(None, code=code)
    if code in PREFILL_CODES:
        return Blame(Role.PREFILL, code=code)
    if code in DECODE_CODES:
        return Blame(Role.DECODE, code=code)
    return Blame(None, ambiguous=True, code=code)
