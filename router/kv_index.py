"""What each worker's prefix cache holds, from its KV events: the router's side of ``GET /kv_events``.

NVIDIA Dynamo's KV router keeps, per worker, the block hashes its engine reported stored and not yet removed
(vLLM's ``BlockStored`` / ``BlockRemoved``), and scores a prompt on a worker by how many of the prompt's leading
block hashes that worker holds. This module does the same for one router: `KvIndex` holds one `WorkerIndex` per
worker URL, applies event batches (``docs/router.md`` describes the wire format), and answers "how many leading
pages of this prompt does that worker hold?".

Hashes are chained page hashes (`page_hash`, the same function as the worker's
``pd_cluster.engine.kv.events.page_hash``; the router imports nothing of the project, and a test checks that both
agree): a hash names the whole prefix up to its page, and a worker's cache is prefix-closed, so the pages a worker
holds of a prompt are the leading hashes found in its set.

**Sync.** A worker's index is *synced* after a snapshot and while each batch continues the last one (same
``instance_id``, sequence numbers without a gap). A gap, a new ``instance_id`` (a restarted worker), an
unreachable worker or an index over ``max_pages`` drops the index: the worker is unsynced, and routing falls
back to the approximate tree until a snapshot has been applied again (`resyncs` counts them by reason).

**Lag.** Events reach the router a poll period after the worker stored the pages. So that a conversation's next
turn, sent right after its answer, still finds the pages its previous turn stored, each routed prompt's page
hashes are *pending* on the chosen worker until a poll that started after that request's part on the worker
ended (the events then say what the worker really kept). Pending hashes count as held.

Pure Python, no I/O; the event loop is the only thread that touches it.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from pd_cluster.common.routing_text import unpack_u64
from pd_cluster.router.text_map import RecentText, TextRoute

try:  # the C loop behind ``Counter.update``: ``m[k] = m.get(k, 0) + 1`` for each k
    from collections import _count_elements
except ImportError:  # pragma: no cover (another Python)
    def _count_elements(mapping: dict, iterable: Iterable) -> None:
        get = mapping.get
        for k in iterable:
            mapping[k] = get(k, 0) + 1

ROOT_HASH = 0
MAX_PENDING_ROUTES = 4096
"""Per worker: the oldest pending routes are dropped past this many (bounded memory)."""
MAX_L3_PAGES = 1 << 19
"""Pages of the cluster-wide KV store the index remembers (the least recently reported are dropped past this)."""


def page_hash(parent: int, token_ids: Sequence[int]) -> int:
    """BLAKE2b (8-byte digest) of the parent hash (8 bytes LE) and the token ids (4 bytes LE each), as an
    unsigned little-endian integer: the worker's ``pd_cluster.engine.kv.events.page_hash``."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little")


def page_hashes(token_ids: Sequence[int], page_size: int, known: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Chained hashes of the full pages of ``token_ids[:-1]`` (an engine always computes a prompt's last token,
    so no page holding it is ever a cache hit). ``known``: the hashes of the first pages, already computed
    (from a prompt with the same leading tokens); hashing goes on after them."""
    out, parent = list(known), known[-1] if known else ROOT_HASH
    for start in range(len(known) * page_size, (len(token_ids) - 1) // page_size * page_size, page_size):
        parent = page_hash(parent, token_ids[start:start + page_size])
        out.append(parent)
    return tuple(out)


@dataclass
class PromptTokens:
    """A prompt's token ids, as the workers tokenize it, and its page hashes per page size (computed once).

    ``prefix``/``shared``: another prompt whose first ``shared`` token ids are this one's too (a conversation's
    earlier turn): the hashes of the pages within them are taken from it, and only the rest are computed.
    """

    token_ids: tuple[int, ...]
    _hashes: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    prefix: "PromptTokens | None" = field(default=None, repr=False)
    shared: int = 0

    def hashes(self, page_size: int) -> tuple[int, ...]:
        got = self._hashes.get(page_size)
        if got is None:
            known: tuple[int, ...] = ()
            if self.prefix is not None:
                full = (len(self.token_ids) - 1) // page_size
                known = self.prefix.hashes(page_size)[:min(self.shared // page_size, full)]
            got = self._hashes[page_size] = page_hashes(self.token_ids, page_size, known)
        return got


class PendingRoute:
    """Pages a routed prompt will most likely leave on a worker; `done` once the worker's part has ended."""

    __slots__ = ("hashes", "done_at")

    def __init__(self, hashes: tuple[int, ...]) -> None:
        self.hashes = hashes
        self.done_at = float("inf")


@dataclass
class WorkerIndex:
    """One worker's cached pages (hash -> how many pages carry it; more than one only on a collision)."""

    instance_id: str | None = None
    page_size: int = 0
    seq: int = 0
    synced: bool = False
    polled_at: float = float("-inf")
    blocks: dict[int, int] = field(default_factory=dict)
    pending: list[PendingRoute] = field(default_factory=list)
    pending_counts: dict[int, int] = field(default_factory=dict)
    text: RecentText = field(default_factory=RecentText)
    """Untokenized prompts routed here, pending (`router.text_map.RecentText`)."""

    def holds(self, h: int) -> bool:
        return h in self.blocks or h in self.pending_counts


class BadBatch(ValueError):
    """A batch that cannot be applied (malformed)."""


def _block_hashes(e: dict) -> list[int]:
    """An event's ``block_hashes``: a list, or packed (``hashes=packed``: base64 of little-endian u64).

    Raises:
        ValueError: neither.
    """
    hashes = e["block_hashes"]
    if isinstance(hashes, str):
        return unpack_u64(hashes)
    if not isinstance(hashes, list):
        raise ValueError("block_hashes is neither a list nor packed")
    return hashes


class KvIndex:
    """`WorkerIndex` per worker URL, fed by `apply`; read by the ``cache_aware`` policy.

    Args:
        max_pages: per worker; a larger index is dropped (reason ``overflow``).
        stale_secs: a synced index whose last good poll is older than this is not used.
    """

    def __init__(self, max_pages: int = 1 << 21, stale_secs: float = 2.0,
                 text_polled: Callable[[int], float] | None = None) -> None:
        """``text_polled(page_size)``: when the text-to-page map was last polled from every source of that page
        size (`TextMap.polled_since`); a text route is confirmed once both that and the worker's own events poll
        started after its end."""
        self.max_pages = max_pages
        self.stale_secs = stale_secs
        self._text_polled = text_polled
        self._workers: dict[str, WorkerIndex] = {}
        self.l3: OrderedDict[int, None] = OrderedDict()  # pages any worker wrote to the cluster-wide KV store
        self.events_received = 0
        self.resyncs: dict[str, int] = {}

    def get(self, url: str) -> WorkerIndex | None:
        return self._workers.get(url)

    def since(self, url: str) -> int | None:
        """The ``since`` of the next poll of `url`: None (ask for a snapshot) unless synced."""
        w = self._workers.get(url)
        return w.seq if w is not None and w.synced else None

    def fresh(self, url: str, now: float) -> bool:
        """Synced, and polled within `stale_secs`."""
        w = self._workers.get(url)
        return w is not None and w.synced and now - w.polled_at <= self.stale_secs

    def forget(self, url: str) -> None:
        """A worker left the registry."""
        self._workers.pop(url, None)

    def drop(self, url: str, reason: str) -> None:
        """Unsync `url` (its next poll asks for a snapshot); pending routes are kept."""
        w = self._workers.get(url)
        if w is not None and (w.synced or w.blocks):
            w.synced, w.blocks, w.seq = False, {}, 0
            self.resyncs[reason] = self.resyncs.get(reason, 0) + 1

    # ---- events ----------------------------------------------------------------------------------------
    def apply(self, url: str, batch: dict, polled_at: float) -> int:
        """Apply one ``/kv_events`` answer polled at `polled_at` (monotonic seconds, when the poll started).

        Returns the number of events applied (0 when the batch was refused and the index dropped).

        Raises:
            BadBatch: the batch is malformed (the index is dropped first).
        """
        w = self._workers.setdefault(url, WorkerIndex())
        try:
            instance, seq, snapshot = str(batch["instance_id"]), int(batch["seq"]), bool(batch["snapshot"])
            page_size, events = int(batch["page_size"]), batch["events"]
            if not isinstance(events, list) or page_size < 1:
                raise ValueError("bad events or page_size")
            if snapshot:  # asked for, or the worker's answer to a `since` it cannot continue from
                if w.synced:
                    self.drop(url, "new_instance" if instance != w.instance_id else "gap")
                w.blocks, w.synced = {}, False
            elif not w.synced or instance != w.instance_id:
                self.drop(url, "new_instance" if instance != w.instance_id else "gap")
                return 0
            elif events and int(events[0]["seq"]) != w.seq + 1:
                self.drop(url, "gap")
                return 0
            w.instance_id, w.page_size = instance, page_size
            for e in events:
                if e.get("medium") == "L3":  # in the store every worker reads, not in this worker's cache
                    self._apply_l3(e)
                else:
                    self._apply_event(w, e)
        except (KeyError, TypeError, ValueError) as exc:
            self.drop(url, "malformed")
            raise BadBatch(f"bad /kv_events answer from {url}: {exc!r}") from None
        if len(w.blocks) > self.max_pages:
            self.drop(url, "overflow")
            return 0
        w.seq, w.synced, w.polled_at = seq, True, polled_at
        self.events_received += len(events)
        self._confirm(w, polled_at)
        return len(events)

    @staticmethod
    def _apply_event(w: WorkerIndex, e: dict) -> None:
        kind, blocks = e["type"], w.blocks
        if kind == "AllBlocksCleared":
            blocks.clear()
            return
        hashes = _block_hashes(e)
        if not isinstance(hashes, array):  # a JSON list (packed hashes are ints already)
            hashes = [int(h) for h in hashes]
        if kind == "BlockStored":
            _count_elements(blocks, hashes)  # blocks[h] = blocks.get(h, 0) + 1 for each, in C
        elif kind == "BlockRemoved":
            get = blocks.get
            if max(map(get, hashes, repeat(0)), default=0) <= 1:  # each held once (or not): all go, in C
                deque(map(blocks.pop, hashes, repeat(None)), maxlen=0)
                return
            for h in hashes:
                left = get(h, 0) - 1
                if left > 0:
                    blocks[h] = left
                else:
                    blocks.pop(h, None)
        else:
            raise ValueError(f"unknown event type {kind!r}")

    def _apply_l3(self, e: dict) -> None:
        if e["type"] != "BlockStored":
            return  # the store's own evictions are not reported: its entries age out of `l3` instead
        l3 = self.l3
        for h in _block_hashes(e):
            h = int(h)
            l3[h] = None
            l3.move_to_end(h)
        while len(l3) > MAX_L3_PAGES:
            l3.popitem(last=False)

    def l3_pages(self, url: str, prompt: PromptTokens) -> int:
        """Leading pages of `prompt` (in `url`'s page size) that some worker wrote to the cluster-wide KV store."""
        w = self._workers.get(url)
        if w is None or w.page_size < 1 or not self.l3:
            return 0
        n = 0
        for h in prompt.hashes(w.page_size):
            if h not in self.l3:
                break
            n += 1
        return n

    # ---- pending routes ----------------------------------------------------------------------------------
    def predict(self, url: str, hashes: tuple[int, ...]) -> PendingRoute | None:
        """Count `hashes` as held by `url` until confirmed (see the module docstring); call ``done(route, t)``
        when the worker's part of the request ends."""
        w = self._workers.get(url)
        if w is None or not hashes:
            return None
        route = PendingRoute(hashes)
        w.pending.append(route)
        for h in hashes:
            w.pending_counts[h] = w.pending_counts.get(h, 0) + 1
        if len(w.pending) > MAX_PENDING_ROUTES:
            self._unpend(w, w.pending.pop(0))
        return route

    def predict_text(self, url: str, hashes: list[int], now: float) -> TextRoute | None:
        """Count an untokenized prompt's text blocks (`hashes`) as held by `url` until confirmed (see
        `RecentText`); call ``done(route, t)`` when the worker's part of the request ends."""
        w = self._workers.get(url)
        return None if w is None or not hashes else w.text.add(hashes, now)

    @staticmethod
    def done(route: PendingRoute | TextRoute, now: float) -> None:
        route.done_at = min(route.done_at, now)

    def _confirm(self, w: WorkerIndex, polled_at: float) -> None:
        if w.text.routes:
            seen = min(polled_at, self._text_polled(w.page_size)) if self._text_polled is not None else polled_at
            w.text.confirm(seen, polled_at)
        if not w.pending:
            return
        keep = []
        for route in w.pending:
            if route.done_at <= polled_at:
                self._unpend(w, route)
            else:
                keep.append(route)
        w.pending = keep

    @staticmethod
    def _unpend(w: WorkerIndex, route: PendingRoute) -> None:
        counts = w.pending_counts
        for h in route.hashes:
            left = counts.get(h, 0) - 1
            if left > 0:
                counts[h] = left
            else:
                counts.pop(h, None)

    # ---- scoring inputs --------------------------------------------------------------------------------
    def cached_pages(self, url: str, prompt: PromptTokens) -> tuple[int, int]:
        """(leading pages of `prompt` that `url` holds or is pending, the prompt's full pages) in the worker's
        page size; (0, 0) for an unknown worker."""
        w = self._workers.get(url)
        if w is None or w.page_size < 1:
            return 0, 0
        hashes = prompt.hashes(w.page_size)
        n = 0
        for h in hashes:
            if not w.holds(h):
                break
            n += 1
        return n, len(hashes)

    def page_sizes(self) -> set[int]:
        """The page sizes of the workers indexed (a prompt's hashes are computed for each)."""
        return {w.page_size for w in self._workers.values() if w.page_size > 0}

    def num_synced(self) -> int:
        return sum(w.synced for w in self._workers.values())

    def num_pages(self, url: str) -> int:
        w = self._workers.get(url)
        return len(w.blocks) if w is not None else 0

    def urls(self) -> Iterable[str]:
        return list(self._workers)
