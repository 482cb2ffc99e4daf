"""Worker load as reported by ``GET /get_load`` (``docs/worker-api.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadReport:
    """One ``/get_load`` answer.

    Counts are requests; ``token_usage`` is used KV pages / all pages (0..1);
    ``received_at`` is the router's monotonic clock, in seconds, at receipt.
    """

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    token_usage: float = 0.0
    num_free_pages: int = 0
    num_total_pages: int = 0
    max_running_requests: int = 0
    num_prefill_bootstrap_queue_reqs: int = 0
    num_prefill_inflight_queue_reqs: int = 0
    num_decode_prealloc_queue_reqs: int = 0
    num_decode_transfer_queue_reqs: int = 0
    received_at: float = 0.0

    @classmethod
    def from_json(cls, body: dict[str, Any], received_at: float) -> "LoadReport":
        """Parse a ``/get_load`` body; missing keys read as 0.

        Raises ``ValueError`` when a present field is not a number.
        """
        def num(key: str, kind: type = int):
            value = body.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"/get_load field {key!r} is not a number: {value!r}")
            return kind(value)

        return cls(
            num_running_reqs=num("num_running_reqs"), num_queue_reqs=num("num_queue_reqs"),
            token_usage=num("token_usage", float), num_free_pages=num("num_free_pages"),
            num_total_pages=num("num_total_pages"),
            max_running_requests=num("max_running_requests"),
            num_prefill_bootstrap_queue_reqs=num("num_prefill_bootstrap_queue_reqs"),
            num_prefill_inflight_queue_reqs=num("num_prefill_inflight_queue_reqs"),
            num_decode_prealloc_queue_reqs=num("num_decode_prealloc_queue_reqs"),
            num_decode_transfer_queue_reqs=num("num_decode_transfer_queue_reqs"),
            received_at=received_at)

    @property
    def waiting(self) -> int:
        """Requests queued anywhere in the worker (admission, bootstrap, pages, KV)."""
        return (self.num_queue_reqs + self.num_prefill_bootstrap_queue_reqs
                + self.num_decode_prealloc_queue_reqs + self.num_decode_transfer_queue_reqs)

    @property
    def requests(self) -> int:
        """Running plus waiting requests: the queue-depth load used by the policies."""
        return self.num_running_reqs + self.waiting
