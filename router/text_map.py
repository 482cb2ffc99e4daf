"""The router's side of the workers' text-to-page maps (``GET /kv_text_map``): routing text on KV events, untokenized.

A worker that tokenizes a prompt (decode and mixed roles) publishes entries ``(text hash, page hash, pages)``: the
text up to some block of the prompt's routing text (``common/routing_text.py``) determines its first ``pages``
pages, the last of which has that page hash (``engine/kv/text_map.py``). `TextMap` keeps them, per page size, in
two generations of plain dicts bounded together by ``max_entries``: new entries and entries used go into the
newer one, and when it holds half the bound the older one is dropped (an entry unused for a generation goes; a
dict lookup is all a hit costs). A new prompt's block hashes are looked up
(`TextMap.lookup`): the mapped blocks give page hashes that each worker's `KvIndex` entry holds or not, exactly as
the hashes of the prompt's token ids would, at the cost of one dict lookup per block of text (`block_chars_for` the page size).

Every source is polled for the entries after the last sequence number it gave (``since``); a new ``instance_id``
starts that source over. Entries are facts about text and tokens, not about a cache, so nothing is dropped when a
source fails or restarts; a source only counts as *fresh* (the map is used) while its last good poll is at most
``stale_secs`` old. Pure Python, no I/O; the event loop is the only thread that touches it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat

from pd_cluster.common.routing_text import block_chars_for, unpack_entries

_MASK = (1 << 64) - 1



@dataclass
class Source:
    """One worker publishing a text-to-page map, as of its last good poll."""

    instance_id: str = ""
    seq: int = 0
    page_size: int = 0
    polled_at: float = float("-inf")
    chars_per_token: float = 0.0


class TextMap:
    """Text hash -> (page hash, pages), per page size, learned from the workers.

    Args:
        max_entries: entries held at most over all page sizes (least recently used first out).
        stale_secs: a source whose last good poll is older does not make the map usable.
    """

    def __init__(self, max_entries: int = 1 << 19, stale_secs: float = 2.0) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.stale_secs = stale_secs
        # page size -> [newer, older] generation: text hash -> pages << 64 | page hash (one int: no tuple to
        # allocate, nothing for the garbage collector to track)
        self._maps: dict[int, list[dict[int, int]]] = {}
        self._sources: dict[str, Source] = {}
        self._newest: dict[int, float] = {}  # page size -> the latest good poll start of any of its sources
        self._cpt: dict[int, float] = {}  # page size -> its sources' mean characters per token
        self._gen_size = max(1, max_entries // 2)  # `_generation_size()` for the page sizes in `_maps`
        self.entries_received = 0

    def __len__(self) -> int:
        return sum(len(new) + len(old) for new, old in self._maps.values())

    def _generation_size(self) -> int:
        return max(1, self.max_entries // (2 * max(1, len(self._maps))))

    def _generations(self, page_size: int) -> list[dict[int, int]]:
        gens = self._maps.get(page_size)
        if gens is None:
            gens = self._maps[page_size] = [{}, {}]
            self._gen_size = self._generation_size()
        return gens

    def _rotate(self, gens: list[dict[int, int]]) -> None:
        """A full newer generation becomes the older one (the older one's entries are dropped)."""
        if len(gens[0]) > self._gen_size:
            gens[0], gens[1] = {}, gens[0]

    def since(self, url: str) -> int | None:
        """The ``since`` of the next poll of `url` (None: everything the source holds)."""
        s = self._sources.get(url)
        return s.seq if s is not None and s.instance_id else None

    def source(self, url: str) -> Source | None:
        """What the last good poll of `url` said (``instance_id``, ``seq``, ``page_size``, ``polled_at``)."""
        return self._sources.get(url)

    def forget(self, url: str) -> None:
        """A source left the registry (its entries stay: they are true of the text)."""
        s = self._sources.pop(url, None)
        if s is not None:
            self._refresh(s.page_size)

    def stale(self, url: str) -> None:
        """A poll of `url` failed: it no longer counts as fresh."""
        s = self._sources.get(url)
        if s is not None:
            s.polled_at = float("-inf")
            self._refresh(s.page_size)

    def _refresh(self, page_size: int) -> None:
        self._newest[page_size] = max((s.polled_at for s in self._sources.values() if s.page_size == page_size),
                                      default=float("-inf"))

    def apply(self, url: str, batch: dict, polled_at: float) -> int:
        """Apply one ``/kv_text_map`` answer (polled at `polled_at`, monotonic seconds); returns the entries added.

        Raises:
            ValueError: a malformed answer.
        """
        instance, seq, page_size = str(batch["instance_id"]), int(batch["seq"]), int(batch["page_size"])
        if page_size < 1 or int(batch.get("block_chars", 0)) != block_chars_for(page_size):
            raise ValueError(f"bad page_size or block_chars from {url}")
        flat = unpack_entries(batch["entries"])
        s = self._sources.setdefault(url, Source())
        s.instance_id, s.seq, s.page_size, s.polled_at = instance, seq, page_size, polled_at
        self._newest[page_size] = max(self._newest.get(page_size, float("-inf")), polled_at)
        cpt = batch.get("chars_per_token")
        if isinstance(cpt, (int, float)) and cpt > 0 and cpt != s.chars_per_token:
            s.chars_per_token = float(cpt)
            values = [x.chars_per_token for x in self._sources.values()
                      if x.page_size == page_size and x.chars_per_token]
            self._cpt[page_size] = sum(values) / len(values)
        gens = self._generations(page_size)
        new = gens[0]
        before = len(new)
        new.update({flat[i]: flat[i + 2] << 64 | flat[i + 1] for i in range(0, len(flat), 3)})
        self.entries_received += len(flat) // 3
        self._rotate(gens)
        return len(new) - before if new is gens[0] else len(flat) // 3

    # ---- reading ----------------------------------------------------------------------------------------
    def fresh(self, page_size: int, now: float) -> bool:
        """Some source of this page size was polled within `stale_secs`."""
        return now - self._newest.get(page_size, float("-inf")) <= self.stale_secs

    def polled_since(self, page_size: int) -> float:
        """The oldest last good poll start among this page size's fresh sources (-inf when none): every entry
        published before then has arrived."""
        times = [s.polled_at for s in self._sources.values() if s.page_size == page_size]
        return min(times) if times else float("-inf")

    def chars_per_token(self, page_size: int) -> float:
        """The sources' mean characters per token (for estimates; 4 before any says)."""
        return self._cpt.get(page_size, 4.0)

    def lookup(self, page_size: int, hashes: list[int]) -> list[tuple[int, int, int]]:
        """The mapped blocks of a prompt (its block hashes, in order): ``(block index, page hash, pages)``. An
        entry found in the older generation moves to the newer one. A prompt none of whose blocks is mapped (one
        that never repeats) costs two membership passes in C."""
        gens = self._maps.get(page_size)
        if gens is None:
            return []
        new, old = gens
        if new.keys().isdisjoint(hashes) and old.keys().isdisjoint(hashes):
            self._rotate(gens)
            return []
        get_new, get_old = new.get, old.get
        out = []
        for k, h in enumerate(hashes):
            v = get_new(h)
            if v is None:
                v = get_old(h)
                if v is None:
                    continue
                new[h] = v
            out.append((k, v & _MASK, v >> 64))
        self._rotate(gens)
        return out


class TextRoute:
    """One prompt routed to a worker as text; ``done_at``: when the worker's part of it ended."""

    __slots__ = ("routed_at", "done_at")

    def __init__(self, routed_at: float) -> None:
        self.routed_at = routed_at
        self.done_at = float("inf")


class RecentText:
    """The text blocks routed to one worker whose pages its KV events may not report yet (*pending*).

    A route stays pending until a poll of the worker's events, and one of the text maps, started after its end
    (`confirm`); ``horizon`` is the routing time of the oldest pending route, and every block routed there at
    or after it counts as held (`depth`). Blocks go in two generations of dicts (block hash -> time routed):
    adding a prompt is one ``dict.update``, and a generation is dropped whole once the horizon has passed it
    (or the newer one holds `MAX_GENERATION` blocks).
    """

    MAX_GENERATION = 1 << 16
    MAX_ROUTES = 4096

    def __init__(self) -> None:
        self.routes: deque[TextRoute] = deque()
        self.horizon = float("inf")
        self._cur: dict[int, float] = {}
        self._old: dict[int, float] = {}
        self._cur_since = float("-inf")

    def add(self, hashes: list[int], now: float) -> TextRoute:
        route = TextRoute(now)
        self.routes.append(route)
        if len(self.routes) > self.MAX_ROUTES:
            self.routes.popleft()
        self.horizon = self.routes[0].routed_at
        if len(self._cur) > self.MAX_GENERATION:
            self._rotate(now)
        self._cur.update(zip(hashes, repeat(now)))
        return route

    def _rotate(self, now: float) -> None:
        self._old, self._cur, self._cur_since = self._cur, {}, now

    def confirm(self, seen: float, now: float) -> None:
        """Routes that ended before `seen` (both polls started after) are confirmed."""
        if self.routes:
            self.routes = deque(r for r in self.routes if r.done_at > seen)
        self.horizon = self.routes[0].routed_at if self.routes else float("inf")
        if self.horizon >= self._cur_since:  # the old generation is all older than every pending route
            self._rotate(now)

    def depth(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` were routed here at or after the horizon. A route adds all its
        blocks at once, so the pending blocks of a prompt are a prefix of it: a binary search finds its end."""
        horizon, get_cur, get_old = self.horizon, self._cur.get, self._old.get
        lo, hi = 0, len(hashes)  # hashes[:lo] pending; hashes[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            t = get_cur(hashes[mid])
            if t is None:
                t = get_old(hashes[mid])
            if t is not None and t >= horizon:  # pending
                lo = mid + 1
            else:
                hi = mid
        return lo
