"""The worker's text-to-page map: what the router needs to route text on the workers' KV events without a tokenizer.

The router scores a prompt on a worker by the leading pages of it that the worker's prefix cache holds
(``docs/router.md``), and pages are named by chained hashes of token ids (``engine/kv/events.py``). Tokenizing every
prompt in the router cost 7-10x the CPU per request of sglang-router's ``cache_aware`` on prompts that never repeat
(``docs/perf/router.md``). Instead, the worker that tokenizes a prompt (decode and mixed roles; ``serving/tokenization.py``) publishes, for text
prefixes of its routing text (``common/routing_text.py``), the page hash of the pages that prefix determines:

    (hash of the text up to block k, hash of the prompt's page n - 1, n)

Entries are published along the prompt (about `MAX_MARKS`, evenly in pages), at the end of each message of a chat
(where its next turn continues), and for the end hash (the whole text: its exact page count). The router learns them by polling ``GET /kv_text_map`` and looks a new prompt's block
hashes up: a prefix it saw anywhere is then matched against each worker's reported pages, exactly as token ids
would be (the same idea as NVIDIA Dynamo's KV router, with the tokenization done once, by the worker that already
does it).

**Which tokens a text prefix determines.** Text after a prefix can change the tokens at its end (a word cut in
two), so a prefix ending at character ``r`` of the rendered text determines the tokens that end at or before the
start of the last whitespace run before ``r``: pre-tokenizers (byte-level BPE's regex, SentencePiece's ``▁``) never
let a token span whitespace into the next word. For a chat, a position in a message's content maps to the rendered
chat template by where that content sits in it (found in order; a position in a ``<role>`` marker maps to the end of
the previous content); a message whose content is not found verbatim or that holds tool calls (which the routing
text leaves out), or a chat whose first message renders differently alone (a template that moves the system
prompt), ends the map there. Token-id prompts map exactly (the
ids whose ``,`` is in the prefix). ``tests/engine/test_text_map.py`` checks on ShareGPT texts and conversations that
the page hashes of published entries equal those of other prompts sharing the prefix.

**Log.** `TextMapLog` numbers entries 1, 2, ... (one sequence per process, ``instance_id``) and holds the last
``max_entries``; a text hash already held is not added again. ``read(since)`` gives the entries after ``since`` (the
oldest held when ``since`` is older); the map is a cache, so a reader that missed entries only routes with less.
"""

from __future__ import annotations

import bisect
import logging
import threading
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from pd_cluster.common.routing_text import (
    block_chars_for,
    full_blocks,
    block_hashes,
    holds_whole_message,
    chat_segments,
    completion_offset,
    pack_entries,
    routing_text,
)
from pd_cluster.engine.kv.events import ROOT_HASH, page_hash

logger = logging.getLogger(__name__)

_SPACE = " \t\n\r\f\v"
MAX_MARKS = 8
"""Entries along one prompt, about (the router's match is then within 1/8 of the prompt's pages)."""


class TextMapLog:
    """The entries a worker published, numbered; written by the tokenizer thread, read by HTTP handlers.

    Args:
        page_size: tokens per KV page of this worker (the prefill workers' too: a PD pair's layouts match).
        max_entries: entries held at most (older ones are dropped first).
    """

    def __init__(self, page_size: int, max_entries: int = 1 << 17) -> None:
        if page_size < 1 or max_entries < 1:
            raise ValueError("page_size and max_entries must be >= 1")
        self.page_size = page_size
        self.max_entries = max_entries
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._items: list[tuple[int, int, int]] = []
        self._head = 0  # items before it were dropped
        self._base = 0  # sequence number of _items[0] minus 1
        self._known: dict[int, int] = {}  # text hash -> its sequence number
        self._chars = 0
        self._tokens = 0

    @property
    def seq(self) -> int:
        return self._base + len(self._items)

    def record(self, entries: Sequence[tuple[int, int, int]]) -> None:
        with self._lock:
            for entry in entries:
                if entry[0] in self._known:
                    continue
                self._items.append(entry)
                self._known[entry[0]] = self._base + len(self._items)
            while len(self._items) - self._head > self.max_entries:
                old = self._items[self._head][0]
                if self._known.get(old) == self._base + self._head + 1:
                    del self._known[old]
                self._head += 1
            if self._head > self.max_entries:
                del self._items[:self._head]
                self._base += self._head
                self._head = 0

    def count(self, chars: int, tokens: int) -> None:
        """A prompt of `chars` characters was `tokens` tokens (the router's estimates of unmapped text)."""
        self._chars += chars
        self._tokens += tokens

    def read(self, since: int | None, limit: int = 4096) -> dict[str, Any]:
        """The entries after `since` (all held ones for None), at most `limit`, as ``GET /kv_text_map``'s answer.

        Raises:
            ValueError: `limit` < 1.
        """
        if limit < 1:
            raise ValueError("limit must be >= 1")
        with self._lock:
            start = max(self._head, (since or 0) - self._base)
            if since is not None and since > self.seq:  # another instance's number: start over
                start = self._head
            items = self._items[start:start + limit]
            seq = self._base + start + len(items)
            more = seq < self.seq
        return {"instance_id": self.instance_id, "page_size": self.page_size,
                "block_chars": block_chars_for(self.page_size),
                "seq": seq, "more": more, "entries": pack_entries(items),
                "chars_per_token": round(self._chars / self._tokens, 3) if self._tokens else None}


# ---- building entries (in the tokenizer thread) ----------------------------------------------------------------
def page_chain(token_ids: Sequence[int], page_size: int, pages: int) -> list[int]:
    """The chained hashes of the first `pages` pages of `token_ids` (`engine.kv.events.page_hash`)."""
    out, parent = [], ROOT_HASH
    for p in range(pages):
        parent = page_hash(parent, token_ids[p * page_size:(p + 1) * page_size])
        out.append(parent)
    return out


def entries(text: str, stable: Sequence[int], token_ids: Sequence[int], page_size: int,
            complete: bool = True, marks: Collection[int] = ()) -> list[tuple[int, int, int]]:
    """Map entries of a prompt whose routing text is `text` and whose tokens are `token_ids`: at most about
    `MAX_MARKS` along the prompt (each at least ``1/MAX_MARKS`` of its pages after the last), one at each of
    `marks`, and the end.

    Args:
        stable: per full block of `text`, in order, how many leading tokens the text up to that block's end
            determines; fewer than the blocks: the map ends there.
        complete: the end hash maps to all of `token_ids` (False: the map ended inside the prompt, no end entry).
        marks: indices of blocks that get an entry whenever they add a page (a chat's message ends: where the
            next turn of the conversation continues).
    """
    bc = block_chars_for(page_size)
    hashes = block_hashes(text, bc)
    full = full_blocks(text, bc)
    num_tokens = len(token_ids)
    last = (num_tokens - 1) // page_size if num_tokens else 0
    stride = max(1, -(-last // MAX_MARKS))
    chain = page_chain(token_ids, page_size, last)
    out, reached = [], 0
    for k, tokens in enumerate(stable[:full]):
        n = min(max(tokens, 0), num_tokens - 1) // page_size
        if n - reached >= stride or (n > reached and k in marks):
            out.append((hashes[k], chain[n - 1], n))
            reached = n
    if complete and len(hashes) > full and len(stable) >= full:
        out.append((hashes[-1], chain[last - 1] if last else 0, last))
    return out


def stable_tokens(rendered: str, ends: Sequence[int], r: int) -> int:
    """Tokens of `rendered` (their end offsets `ends`, non-decreasing) determined by ``rendered[:r]`` alone."""
    i = r - 1
    while i >= 0 and rendered[i] not in _SPACE:
        i -= 1
    while i > 0 and rendered[i - 1] in _SPACE:
        i -= 1
    if i <= 0:
        return 0
    return bisect.bisect_right(ends, i)


def _ends(offsets: Sequence[tuple[int, int]]) -> list[int]:
    out, top = [], 0
    for _, end in offsets:
        top = max(top, end)
        out.append(top)
    return out


def completion_entries(data: dict[str, Any], prompt: str, ids: Sequence[int],
                       offsets: Sequence[tuple[int, int]], page_size: int) -> list[tuple[int, int, int]]:
    """Entries of a completion's single text prompt (`ids` and their character `offsets` in `prompt`)."""
    text = routing_text(data, chat=False)
    at = completion_offset(data)
    if text[at:] != prompt:
        return []
    ends, bc = _ends(offsets), block_chars_for(page_size)
    stable = [stable_tokens(prompt, ends, c - at) if c > at else 0 for c in range(bc, len(text) + 1, bc)]
    return entries(text, stable, ids, page_size)


def token_id_entries(data: dict[str, Any], ids: Sequence[int], page_size: int) -> list[tuple[int, int, int]]:
    """Entries of a completion whose prompt is token ids (exact: the ids whose ``,`` is in the prefix)."""
    text = routing_text(data, chat=False)
    at = completion_offset(data)
    bc = block_chars_for(page_size)
    stable = [text.count(",", at, c) if c > at else 0 for c in range(bc, len(text) + 1, bc)]
    return entries(text, stable, ids, page_size)


def chat_entries(data: dict[str, Any], rendered: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
                 lead: int, page_size: int, first_alone: str | None) -> list[tuple[int, int, int]]:
    """Entries of a chat.

    Args:
        rendered: the chat template's text; `offsets`: the character offsets of its encoded ids.
        ids: the prompt's ids: `lead` ids (a BOS) in front of the encoded text's.
        first_alone: the first message rendered alone (None when the chat has one message).
    """
    text = routing_text(data, chat=True)
    segments = chat_segments(data)
    found: list[tuple[int, int, int, int]] = []  # (marker start, content start, content length, rendered start)
    at = 0
    messages = [m for m in data.get("messages") or () if isinstance(m, dict)]
    for n, (marker, start, content) in enumerate(segments):
        if not holds_whole_message(messages[n]):  # the rest of the rendered chat is not in the routing text
            break
        where = rendered.find(content, at)
        if where < 0:
            break
        if n == 0 and first_alone is not None:
            alone = first_alone.find(content)
            if alone < 0 or first_alone[:alone + len(content)] != rendered[:where + len(content)]:
                break
        found.append((marker, start, len(content), where))
        at = where + len(content)
    if not found:
        return []
    complete = len(found) == len(segments)
    mapped_to = found[-1][1] + found[-1][2]  # routing text mapped up to here
    ends, bc = _ends(offsets), block_chars_for(page_size)
    stable, i = [], 0
    for c in range(bc, len(text) + 1, bc):
        if c > mapped_to and not complete:
            break
        while i + 1 < len(found) and found[i + 1][0] <= c:
            i += 1
        _, start, length, where = found[i]
        if c < start:  # inside the <role> marker: up to the end of the previous content
            r = found[i - 1][3] + found[i - 1][2] if i else 0
        else:
            r = where + min(c - start, length)
        stable.append(lead + stable_tokens(rendered, ends, r) if r else 0)
    marks = {(start + length) // bc - 1 for _, start, length, _ in found}  # each message's last block
    return entries(text, stable, ids, page_size, complete, marks)

