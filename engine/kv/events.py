"""KV cache events: what a worker's prefix cache stored and evicted, by chained page hash.

The idea and the event names are vLLM's KV events (``vllm/distributed/kv_events.py``: ``BlockStored`` with
``block_hashes``, ``parent_block_hash``, ``token_ids`` and ``block_size``, ``BlockRemoved``, ``AllBlocksCleared``,
batches with sequence numbers and a replay path) as consumed by NVIDIA Dynamo's KV router (one index of block
hashes per worker, scored by overlap against load). Here the transport is the worker's ``GET /kv_events`` (HTTP,
which the router already speaks) and the replay path is a snapshot of the whole cache on request.

**Hash.** A page's hash is ``page_hash(parent_hash, token_ids)``: BLAKE2b with an 8-byte digest over the parent's
hash (8 bytes, little endian; `ROOT_HASH` for a prompt's first page) followed by the page's token ids (4 bytes each,
little endian), read as an unsigned little-endian integer. It identifies the whole prefix up to and including the
page, is the same in every process and on every machine (Python's ``hash()`` is salted per process), and the
router computes it from token ids without importing the engine (`pd_cluster.router.kv_index.page_hashes` is the
same function; ``tests/router/test_kv_index.py`` checks they agree). A collision can only misroute a request:
the engine's cache is keyed by exact tokens, so it never serves another prefix's KV.

**Log.** `KVEventLog` is the prefix cache's observer (`PrefixCache.observer`): the engine thread reports pages
stored and removed; HTTP handlers read batches from another thread (one lock). Memory is bounded: the events held
cover at most ``max_pages`` pages (older events are dropped, and a reader that asks for them gets a snapshot
instead), and the page -> hash map holds one entry per cached page.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pd_cluster.common.routing_text import pack_u64

logger = logging.getLogger(__name__)

ROOT_HASH = 0
"""The parent hash of a prompt's first page."""


def page_hash(parent: int, token_ids: Sequence[int], digest_size: int = 8) -> int:
    """The chained hash of one page (see the module docstring); an unsigned 64-bit integer.

    `digest_size` 16 gives the 128-bit chain that names pages in the cluster-wide KV store
    (`pd_cluster.engine.kv.l3.keys`): the parent is then 16 bytes too.
    """
    h = hashlib.blake2b(parent.to_bytes(digest_size, "little"), digest_size=digest_size)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class BlockStored:
    """Pages that joined the cache, in chain order; the first one's parent is `parent_block_hash`
    (None for a prompt's first page). `medium` (vLLM's field): None for the worker's own cache; ``"L3"`` for pages
    this worker wrote to the cluster-wide KV store, which every worker can read (no parent or token ids then:
    the hashes name whole prefixes)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None

    def to_json(self, token_ids: bool = True) -> dict:
        out = {"type": "BlockStored", "block_hashes": list(self.block_hashes),
               "parent_block_hash": self.parent_block_hash, "block_size": self.block_size}
        if token_ids:
            out["token_ids"] = list(self.token_ids)
        if self.medium is not None:
            out["medium"] = self.medium
        return out


@dataclass(frozen=True)
class BlockRemoved:
    """Pages evicted from the cache."""

    block_hashes: tuple[int, ...]

    def to_json(self, token_ids: bool = True) -> dict:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes)}


@dataclass(frozen=True)
class AllBlocksCleared:
    """Everything before is void (a snapshot starts with it)."""

    def to_json(self, token_ids: bool = True) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """One answer of `KVEventLog.read`.

    Attributes:
        instance_id: this log's id (new in every process: a restarted worker has a new one).
        page_size: tokens per page.
        seq: the sequence number the reader is at after this batch (ask for ``since=seq`` next).
        events: (sequence number, event) in order.
        snapshot: the events are the whole cache as of `seq` (starting with `AllBlocksCleared`), not a delta.
        more: events after `seq` exist already (the batch was cut at the reader's limit).
    """

    instance_id: str
    page_size: int
    seq: int
    events: tuple[tuple[int, KVEvent], ...]
    snapshot: bool
    more: bool = False

    def to_json(self, token_ids: bool = True, packed: bool = False) -> dict:
        """The wire form; `token_ids` False leaves the stored pages' token ids out (a reader that only needs
        the hashes, as the router); `packed`: each event's ``block_hashes`` as one base64 string of
        little-endian unsigned 64-bit integers (`pd_cluster.common.routing_text.pack_u64`) instead of a list."""
        events = []
        for s, e in self.events:
            out = e.to_json(token_ids)
            out["seq"] = s
            if packed and "block_hashes" in out:
                out["block_hashes"] = pack_u64(out["block_hashes"])
            events.append(out)
        return {"instance_id": self.instance_id, "page_size": self.page_size, "seq": self.seq,
                "snapshot": self.snapshot, "more": self.more, "events": events}


class KVEventLog:
    """The events of one prefix cache, numbered 1, 2, ...; the cache's observer.

    Args:
        page_size: tokens per page.
        max_pages: bound on the pages the held events cover (older events are dropped).
    """

    def __init__(self, page_size: int, max_pages: int = 16384) -> None:
        if page_size < 1 or max_pages < 1:
            raise ValueError("page_size and max_pages must be >= 1")
        self.page_size = page_size
        self.max_pages = max_pages
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[tuple[int, KVEvent]] = deque()
        self._held_pages = 0
        self._seq = 0
        self._pages: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}  # page -> (hash, parent hash, tokens)

    # ---- the observer (engine thread) ----------------------------------------------------------
    def stored(self, parent_page: int | None, pages: Sequence[int], tokens: Sequence[tuple[int, ...]]) -> None:
        """`pages` (a chain, with their token tuples) joined the cache under `parent_page` (None: the root)."""
        if not pages:
            return
        with self._lock:
            if parent_page is not None and parent_page not in self._pages:
                # under a page never reported (a windowed group 0's hollow path on a PD decode): left out, so the
                # router is never told of a page it could not reach by hash
                logger.debug("KV events: %d pages cached under unreported page %d left out", len(pages), parent_page)
                return
            parent = self._pages[parent_page][0] if parent_page is not None else None
            first_parent, hashes, flat = parent, [], []
            for page, toks in zip(pages, tokens):
                h = page_hash(ROOT_HASH if parent is None else parent, toks)
                self._pages[page] = (h, parent, toks)
                hashes.append(h)
                flat.extend(toks)
                parent = h
            self._append(BlockStored(tuple(hashes), first_parent, tuple(flat), self.page_size), len(pages))

    def removed(self, pages: Sequence[int]) -> None:
        """`pages` left the cache."""
        if not pages:
            return
        with self._lock:
            hashes = tuple(self._pages.pop(p)[0] for p in pages if p in self._pages)  # only pages reported stored
            if hashes:
                self._append(BlockRemoved(hashes), len(hashes))

    def l3_stored(self, hashes: Sequence[int]) -> None:
        """Pages (by hash) this worker wrote to the cluster-wide KV store (any thread): one ``BlockStored`` with
        medium ``"L3"``, which the router adds to its cluster-wide set (``docs/kv-store.md``)."""
        if hashes:
            with self._lock:
                self._append(BlockStored(tuple(hashes), None, (), self.page_size, "L3"), len(hashes))

    def _append(self, event: KVEvent, num_pages: int) -> None:
        self._seq += 1
        self._events.append((self._seq, event))
        self._held_pages += num_pages
        while self._held_pages > self.max_pages and len(self._events) > 1:
            _, old = self._events.popleft()
            self._held_pages -= _pages_of(old)

    # ---- readers (any thread) -------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """The last event's sequence number (0 before any)."""
        return self._seq

    @property
    def num_pages(self) -> int:
        """Pages cached now (as reported to this log)."""
        return len(self._pages)

    def read(self, since: int | None, limit: int = 4096) -> KVEventBatch:
        """The events after `since`, at most `limit` of them; a snapshot when `since` is None, ahead of this log
        (another instance's number) or older than the oldest event held.

        Raises:
            ValueError: `limit` < 1.
        """
        if limit < 1:
            raise ValueError("limit must be >= 1")
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if since is None or since > self._seq or since < oldest - 1:
                entries = list(self._pages.values())
                return KVEventBatch(self.instance_id, self.page_size, self._seq, self._snapshot(entries), True)
            events = [(s, e) for s, e in self._events if s > since]  # bounded by max_pages
        more = len(events) > limit
        events = events[:limit]
        seq = events[-1][0] if events else since
        return KVEventBatch(self.instance_id, self.page_size, seq, tuple(events), False, more)

    def _snapshot(self, entries: list[tuple[int, int | None, tuple[int, ...]]]) -> tuple[tuple[int, KVEvent], ...]:
        """The cache as events: parents come before children (dict order is insertion order), and runs of a
        chain share one `BlockStored`."""
        seq, out = self._seq, [(self._seq, AllBlocksCleared())]
        run: list[tuple[int, int | None, tuple[int, ...]]] = []
        for entry in entries + [None]:
            if run and (entry is None or entry[1] != run[-1][0]):
                out.append((seq, BlockStored(tuple(e[0] for e in run), run[0][1],
                                             tuple(t for e in run for t in e[2]), self.page_size)))
                run = []
            if entry is not None:
                run.append(entry)
        return tuple(out)


def _pages_of(event: KVEvent) -> int:
    return len(event.block_hashes) if isinstance(event, (BlockStored, BlockRemoved)) else 0
