"""Tokenization off the event loop, with a length check that runs before it.

A worker's event loop streams every running request, so a long tokenization
there freezes them all (a 25 MB prompt took 33.5 s). Two defences:

1. **A bound before tokenizing.** One token covers at most `max_bytes_per_token`
   UTF-8 bytes of text, so a text of B bytes needs at least ceil(B / N) tokens.
   N is the longest vocabulary (or added) token's string in UTF-8 bytes; the
   stored strings of SentencePiece (``▁`` for a space: 3 bytes for 1) and
   byte-level BPE (``Ġ``: 2 bytes for 1, ``<0xE2>``: 6 for 1) never cover more
   bytes of text than they hold. A normalizer that can shrink text before the
   model (Unicode NFC/NFKC, lowercasing) can make a token cover up to 3x more:
   N is then multiplied by 4. A normalizer that can delete text (stripping,
   regex replacements) has no bound: the check is then off and only the thread
   pool protects the loop. Characters come first (``len`` is free and every
   character is at least one byte), then bytes.
2. **A thread.** Tokenization and chat templates run in a one-thread pool
   (`ThreadPoolExecutor`, as vLLM does), so the loop keeps streaming; one thread
   because the Rust tokenizer must not be reconfigured concurrently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_cluster.engine.kv.text_map import TextMapLog, chat_entries, completion_entries, token_id_entries
from pd_cluster.serving.errors import HTTPError

logger = logging.getLogger("pd.serving")

_SHRINKING = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase", "StripAccents", "Precompiled"}
_NORMALIZER_FACTOR = 4


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of input text one token of `tokenizer` can cover, or None when unbounded.

    See the module docstring for the derivation; at least 4 (an ``<unk>`` covers one character).
    """
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        longest = max(longest, len(str(added).encode("utf-8", "surrogatepass")))
    longest = max(longest, 4)
    factor = _normalizer_factor(tokenizer)
    return None if factor is None else longest * factor


def _normalizer_factor(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return _NORMALIZER_FACTOR  # a slow tokenizer: assume Unicode normalization
    spec = json.loads(backend.to_str()).get("normalizer")
    factor = 1
    stack = [spec] if spec else []
    while stack:
        node = stack.pop()
        kind = node.get("type")
        if kind == "Sequence":
            stack.extend(node.get("normalizers", []))
        elif kind in ("Prepend", "Append"):
            continue
        elif kind == "Replace" and "String" in node.get("pattern", {}):
            if len(node.get("content", "").encode()) < len(node["pattern"]["String"].encode()):
                return None
        elif kind in _SHRINKING:
            factor = _NORMALIZER_FACTOR
        else:  # Strip, BertNormalizer, regex Replace, unknown: may delete text
            return None
    return factor


class Tokenization:
    """The worker's tokenizer behind a one-thread pool and a pre-tokenization length bound.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        context_length: the engine's ``--context-length`` (tokens).
    """

    def __init__(self, tokenizer: Any, context_length: int, text_map: TextMapLog | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        # the text-to-page map needs character offsets: a fast tokenizer's
        self.text_map = text_map if getattr(tokenizer, "is_fast", False) else None
        self.bytes_per_token = max_bytes_per_token(tokenizer)
        if self.bytes_per_token is None:
            logger.warning("the tokenizer's normalizer may delete text: prompts are not length-checked before "
                           "tokenization (they are still tokenized off the event loop)")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args: Any) -> Any:
        """``fn(*args)`` in the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- the bound --------------------------------------------------------------------
    def check_fits(self, texts: list[str], param: str) -> None:
        """Refuse texts that cannot fit the context with one output token, whatever they tokenize to, without
        tokenizing them (a larger output budget is checked once the prompt's length is known).

        Args:
            texts: the prompt's text parts (a chat's message contents).
            param: the field to blame (``prompt`` or ``messages``).

        Raises:
            HTTPError: 400 ``context_length_exceeded``.
        """
        n = self.bytes_per_token
        if n is None:
            return
        limit = self.context_length - 1
        chars = sum(len(t) for t in texts)
        if math.ceil(chars / n) <= limit:
            nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
            if math.ceil(nbytes / n) <= limit:
                return
        else:
            nbytes = chars  # at least
        raise HTTPError(
            400, f"This model's maximum context length is {self.context_length} tokens. However, your "
                 f"{param} has at least {math.ceil(nbytes / n)} tokens ({nbytes} bytes or more, and one token "
                 f"covers at most {n} bytes), which leaves no room for the completion. "
                 f"Please reduce the length of the {param}.", param, "context_length_exceeded")

    # ---- in the thread ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, body: dict[str, Any] | None = None) -> list[int]:
        """`text`'s ids; with the request's `body`, its text-to-page map entries are published too."""
        if self.text_map is None or body is None:
            return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        self._publish(completion_entries, body, text, enc.input_ids, enc.offset_mapping, self.text_map.page_size)
        return enc.input_ids

    def prompt_ids(self, ids: list[int], body: dict[str, Any]) -> list[int]:
        """A completion's token-id prompt, as given; its map entries are published."""
        if self.text_map is not None:
            try:
                self.text_map.record(token_id_entries(body, ids, self.text_map.page_size))
            except Exception:  # noqa: BLE001 - a failure there costs the map, never the request
                logger.debug("text map entries not built", exc_info=True)
        return ids

    def chat_ids(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None, bos: bool = False,
                 body: dict[str, Any] | None = None) -> list[int]:
        """The chat template's token ids, with the BOS in front when `bos` (and the tokenizer has one); `tools`
        (OpenAI's ``tools``) reach the template as transformers' ``apply_chat_template(tools=...)``. With the
        request's `body`, its text-to-page map entries are published too."""
        text = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        lead = [self.tokenizer.bos_token_id] if bos and self.tokenizer.bos_token_id is not None else []
        if self.text_map is None or body is None:
            return lead + self.tokenizer(text, add_special_tokens=False).input_ids
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = lead + enc.input_ids
        first = None
        if len(conversation) > 1:
            try:
                first = self.tokenizer.apply_chat_template(conversation[:1], tools=tools, tokenize=False,
                                                           add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - a template that refuses one message: no map for this chat
                return ids
        self._publish(chat_entries, body, text, ids, enc.offset_mapping, len(lead), self.text_map.page_size, first)
        return ids

    def _publish(self, build, body: dict[str, Any], text: Any, ids: list[int], *args: Any) -> None:
        """Record `build(body, text, ids, *args)`'s entries; a failure there costs the map, never the request."""
        try:
            self.text_map.record(build(body, text, ids, *args))
            if isinstance(text, str):
                self.text_map.count(len(text), len(ids))
        except Exception:  # noqa: BLE001
            logger.debug("text map entries not built", exc_info=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
