"""The router tokenizer's prompt cache: token ids of recent prompts, by request, bounded in token ids.

A prompt seen before (the same completion text, the same chat messages) is answered from here on the event
loop; a chat's cached earlier turn lends its ids to the next turn (``router.tokenizer``). Least recently used
entries go first once ``max_tokens`` ids are held; the event loop reads and the tokenizer's threads write, so
every access takes one uncontended lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pd_cluster.router.kv_index import PromptTokens


@dataclass
class Cached:
    """A tokenized prompt in the cache: its `PromptTokens`; for chats, the rendered text, its ids (without BOS)
    and the last place in it where a continuation may be encoded alone (``cut_chars`` characters, ``cut_ids``
    ids: just after an added token; 0 when there is none)."""

    prompt: PromptTokens
    text: str | None = None
    text_ids: tuple[int, ...] = ()
    cut_chars: int = 0
    cut_ids: int = 0

    @property
    def size(self) -> int:
        return len(self.prompt.token_ids) + len(self.text_ids)


class PromptCache:
    """Tokenized prompts by request key, least recently used first out; bounded by ``max_tokens`` ids held.
    Thread-safe (the event loop reads it, the pool's threads fill it)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Any, Cached] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any, count: bool = True) -> Cached | None:
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
            if count:
                if got is None:
                    self.misses += 1
                else:
                    self.hits += 1
            return got

    def put(self, key: Any, entry: Cached) -> None:
        if entry.size > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.tokens -= old.size
            self._entries[key] = entry
            self.tokens += entry.size
            while self.tokens > self.max_tokens and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self.tokens -= dropped.size
