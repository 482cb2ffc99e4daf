"""The router's tokenizer: a request's prompt as the workers will tokenize it, for routing on KV events.

NVIDIA Dynamo's frontend tokenizes in front of its KV router for the same reason: block hashes are computed from
token ids, and requests arrive as text or chat messages. This mirrors what a worker does
(``docs/worker-api.md``): a completion's text prompt is encoded with ``add_special_tokens`` (default true), token
ids are taken as they are; chat messages go through the model's chat template (transformers'
``apply_chat_template`` with ``add_generation_prompt``, default true), are encoded without special tokens, and get
the BOS token in front when ``add_special_tokens`` is true. Requests this cannot reproduce exactly (tools, tool
calls, message parts other than text, several prompts) get no token ids and are routed by the approximate tree.
A wrong guess can only misroute: the workers tokenize for themselves.

The tokenizer loads in the background at start-up (transformers imports in seconds); until it has loaded every
request is routed by the tree. Tokenization runs in a one-thread pool, off the event loop; a prompt longer than
``max_chars`` characters is cut there, and its last `CUT_MARGIN` tokens are dropped (the tokens at a cut may
differ from those of the whole text), so its hashes cover a prefix.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_cluster.router.kv_index import PromptTokens

log = logging.getLogger("pd_cluster.router.tokenizer")

CUT_MARGIN = 32
"""Tokens dropped after a cut (see the module docstring)."""


class RouterTokenizer:
    """The model's tokenizer (``--tokenizer-path``) behind a one-thread pool.

    Args:
        path: the model or tokenizer folder, as the workers load it.
        max_chars: longer prompts are cut (see the module docstring).
    """

    def __init__(self, path: str, max_chars: int) -> None:
        self.path = path
        self.max_chars = max_chars
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenizer")
        self._tokenizer: Any = None
        self.error: str | None = None

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def start_loading(self) -> None:
        """Load in the pool's thread; requests before it has loaded get no token ids."""
        self._pool.submit(self._load)

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            tokenizer.model_max_length = sys.maxsize  # the workers check lengths; no warning per long prompt
            self._tokenizer = tokenizer
            log.info("router tokenizer loaded", extra={"path": self.path})
        except Exception as exc:  # noqa: BLE001 - routing falls back to the approximate tree
            self.error = repr(exc)
            log.error("router tokenizer failed to load; cache_aware uses the approximate tree",
                      extra={"path": self.path, "reason": self.error})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prompt(self, data: dict[str, Any], chat: bool, page_sizes: Iterable[int] = ()) -> PromptTokens | None:
        """The prompt's token ids (and its page hashes for `page_sizes`), or None when not reproducible or not
        loaded yet."""
        if self._tokenizer is None:
            return None
        sizes = tuple(page_sizes)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._prompt, data, chat, sizes)

    def _prompt(self, data: dict[str, Any], chat: bool, page_sizes: tuple[int, ...]) -> PromptTokens | None:
        try:
            ids = self.chat_ids(data) if chat else self.completion_ids(data)
        except Exception:  # noqa: BLE001 - a template or tokenizer error: the worker will say what is wrong
            return None
        if not ids:
            return None
        prompt = PromptTokens(tuple(ids))
        for size in page_sizes:
            prompt.hashes(size)
        return prompt

    # ---- in the thread ----------------------------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        cut = len(text) > self.max_chars
        ids = self._tokenizer(text[:self.max_chars], add_special_tokens=add_special_tokens).input_ids
        return ids[:-CUT_MARGIN] if cut else ids

    def completion_ids(self, data: dict[str, Any]) -> list[int] | None:
        """A completion's prompt ids, or None (several prompts, or not a prompt)."""
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        special = data.get("add_special_tokens", True)
        if isinstance(prompt, str) and isinstance(special, bool):
            return self._encode(prompt, special)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt[:self.max_chars]
        return None

    def chat_ids(self, data: dict[str, Any]) -> list[int] | None:
        """A chat's prompt ids through the chat template, or None (tools or parts the router does not render)."""
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages or data.get("tools") or data.get("chat_template_kwargs"):
            return None
        conversation = []
        for m in messages:
            if not isinstance(m, dict) or m.get("tool_calls") or not isinstance(m.get("role"), str):
                return None
            msg = {"role": m["role"], "content": _text(m.get("content"))}
            if msg["content"] is None:
                return None
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    msg[key] = m[key]
            conversation.append(msg)
        generation, special = data.get("add_generation_prompt", True), data.get("add_special_tokens", False)
        if not isinstance(generation, bool) or not isinstance(special, bool):
            return None
        tok = self._tokenizer
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        ids = self._encode(text, False)
        if special and tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + ids
        return ids


def _text(content: Any) -> str | None:
    """A message's content as the workers render it: a string, text parts joined, "" for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            parts.append(part["text"])
        return "".join(parts)
    return None
