"""Counters of the cluster-wide KV store tier, read by the worker's metrics (``docs/kv-store.md``, Metrics)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

LATENCY_WINDOW = 4096


@dataclass
class L3Stats:
    """Totals since start (written by the tier's threads under `lock`; read by the metrics after each step).

    Attributes:
        prefetches: reads started (requests with pages past their local prefix).
        lookup_pages: pages looked up in the store; hit_pages: of those, read and checked.
        read_bytes, read_seconds: bytes read (values) and the time of the lookups and reads.
        written_pages, write_bytes, write_seconds: pages the store holds after a write, bytes sent, time spent.
        write_dropped_pages: pages not written (store unavailable, or the write queue full).
        loaded_pages, loaded_bytes: pages copied from a read into the device pool (a hit served).
        corrupt_pages: pages refused on read (`keys.BadPage`); recomputed.
        prefetch_timeouts: requests that stopped waiting for their read.
        disconnects: times the store became unavailable.
        read_latencies, write_latencies: seconds of each read / write batch since the last `drain` (the metrics'
            histograms take them).
    """

    prefetches: int = 0
    lookup_pages: int = 0
    hit_pages: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_pages: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    write_dropped_pages: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    corrupt_pages: int = 0
    prefetch_timeouts: int = 0
    disconnects: int = 0
    read_latencies: list[tuple[float, int]] = field(default_factory=list)
    write_latencies: list[tuple[float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def on_read(self, looked_up: int, hits: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.lookup_pages += looked_up
            self.hit_pages += hits
            self.read_bytes += nbytes
            self.read_seconds += seconds
            if len(self.read_latencies) < LATENCY_WINDOW:
                self.read_latencies.append((seconds, hits))

    def on_write(self, pages: int, stored: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.written_pages += stored
            self.write_dropped_pages += pages - stored
            self.write_bytes += nbytes
            self.write_seconds += seconds
            if len(self.write_latencies) < LATENCY_WINDOW:
                self.write_latencies.append((seconds, pages))

    def drain(self) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
        """The (seconds, pages) of the reads and writes since the last call."""
        with self.lock:
            reads, writes = self.read_latencies, self.write_latencies
            self.read_latencies, self.write_latencies = [], []
        return reads, writes
