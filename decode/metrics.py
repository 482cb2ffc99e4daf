"""The decode worker's counters of its own KV reuse (delta transfers and local prefills).

Names follow the worker's other ``pd:`` metrics (``docs/worker-api.md``); no
anchor project has a counter for these concepts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class DecodeReuseMetrics:
    """What a decode worker's own prefix cache saved.

    Args:
        registry: the worker's registry.

    Attributes:
        saved_bytes: ``pd:kv_transfer_saved_bytes`` (bytes): prompt pages this worker's prefix cache held
            when a remote request was admitted and its decode reads, times the page's bytes (all layers, K and
            V; a hybrid pool: each KV group's page from its window on), counted when the request starts
            running; these pages were not transferred.
        window_skipped_bytes: ``pd:kv_transfer_window_skipped_bytes`` (bytes): pages of a hybrid model's
            windowed KV groups (sliding-window or chunked layers) behind the window of the request's first
            decode query, times the page's bytes: its decode never reads them, so they were not transferred
            (nor held here, even where its prefix cache had them); counted when the request starts running.
        local_prefills: ``pd:decode_local_prefill_requests``: remote requests prefilled here because their
            uncached rest was at most ``--max-local-prefill-length`` tokens (no ``/prefill`` call).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.saved_bytes = Counter("pd:kv_transfer_saved_bytes",
                                   "decode: KV bytes of prompt pages its own prefix cache held, not transferred",
                                   registry=registry)
        self.window_skipped_bytes = Counter(
            "pd:kv_transfer_window_skipped_bytes",
            "decode: KV bytes of windowed layers' prompt pages behind the window, not transferred", registry=registry)
        self.local_prefills = Counter("pd:decode_local_prefill_requests",
                                      "decode: remote requests prefilled locally (--max-local-prefill-length)",
                                      registry=registry)
