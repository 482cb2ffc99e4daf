"""The fake worker's KV events and text-to-page map (``--kv-events``): what a real worker publishes, at a fake's cost.

A real decode or mixed worker tokenizes each prompt, caches its full pages and publishes both the pages
(``GET /kv_events``, ``engine/kv/events.py``) and which text prefixes make which pages (``GET /kv_text_map``,
``engine/kv/text_map.py``). The fake does the same with the same code, on fake tokens: each whitespace-separated word
of the request's routing text (``common/routing_text.py``) is one token, whose id is the word's CRC-32. Its pages go
into a least-recently-used page cache of ``--max-total-num-tokens`` tokens, whose stores and evictions are the
events. So a router in front of the fake routes on KV events and learns the map exactly as in front of real workers,
and pays the same to do it (``bench/scripts/router_overhead.py``).
"""

from __future__ import annotations

import json
import re
import zlib
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs

from pd_cluster.common.routing_text import block_chars_for, routing_text
from pd_cluster.engine.kv.events import ROOT_HASH, KVEventLog, page_hash
from pd_cluster.engine.kv.text_map import TextMapLog, entries, stable_tokens

_WORD = re.compile(r"\S+")


class FakeKv:
    """A page cache of `max_pages` pages of `page_size` fake tokens, with its event log and text map."""

    def __init__(self, page_size: int, max_pages: int) -> None:
        self.page_size = page_size
        self.max_pages = max(1, max_pages)
        self.events = KVEventLog(page_size)
        self.text_map = TextMapLog(page_size)
        self._pages: OrderedDict[int, int] = OrderedDict()  # chain hash -> page id, least recently used first
        self._next_page = 1

    def observe(self, body: dict[str, Any], chat: bool) -> int:
        """A request arrived: publish its map entries and cache its full pages; returns its prompt tokens."""
        text = routing_text(body, chat)
        words = list(_WORD.finditer(text))
        ids = [zlib.crc32(w.group().encode("utf-8", "surrogatepass")) for w in words]
        ends = [w.end() for w in words]
        bc = block_chars_for(self.page_size)
        stable = [stable_tokens(text, ends, c) for c in range(bc, len(text) + 1, bc)]
        self.text_map.record(entries(text, stable, ids, self.page_size))
        self.text_map.count(len(text), len(ids))
        self._cache(ids)
        return len(ids)

    def _cache(self, ids: list[int]) -> None:
        ps, parent, parent_page = self.page_size, ROOT_HASH, None
        new_pages, new_tokens = [], []
        for p in range(len(ids) // ps):
            tokens = tuple(ids[p * ps:(p + 1) * ps])
            h = page_hash(parent, tokens)
            page = self._pages.get(h)
            if page is not None and not new_pages:
                self._pages.move_to_end(h)
                parent, parent_page = h, page
                continue
            page = self._next_page
            self._next_page += 1
            self._pages[h] = page
            new_pages.append(page)
            new_tokens.append(tokens)
            parent = h
        if new_pages:
            self.events.stored(parent_page, new_pages, new_tokens)
        evicted = []
        while len(self._pages) > self.max_pages:
            evicted.append(self._pages.popitem(last=False)[1])
        if evicted:
            self.events.removed(evicted)

    def kv_events(self, query: str) -> bytes:
        q = parse_qs(query)
        since = int(q["since"][0]) if "since" in q else None
        limit = int(q.get("limit", ["4096"])[0])
        batch = self.events.read(since, limit)
        return _dumps(batch.to_json(q.get("token_ids", ["true"])[0] != "false", q.get("hashes", [""])[0] == "packed"))

    def kv_text_map(self, query: str) -> bytes:
        q = parse_qs(query)
        since = int(q["since"][0]) if "since" in q else None
        return _dumps(self.text_map.read(since, int(q.get("limit", ["4096"])[0])))


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()
