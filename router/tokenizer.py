"""The router's tokenizer: a request's prompt as the workers will tokenize it, for routing on KV events.

NVIDIA Dynamo's frontend tokenizes in front of its KV router for the same reason: block hashes are computed from
token ids, and requests arrive as text or chat messages. This mirrors what a worker does
(``docs/worker-api.md``): a completion's text prompt is encoded with ``add_special_tokens`` (default true), token
ids are taken as they are; chat messages go through the model's chat template (transformers'
``apply_chat_template`` with ``add_generation_prompt``, default true), are encoded without special tokens, and get
the BOS token in front when ``add_special_tokens`` is true. Requests this cannot reproduce exactly (tools, tool
calls, message parts other than text, several prompts) get no token ids and are routed by the approximate tree.
A wrong guess can only misroute: the workers tokenize for themselves.

**Cost.** Encoding is the model's fast tokenizer itself (``tokenizers``, Rust, the object transformers wraps),
called with ``encode_batch``, which releases the GIL. Three layers keep it off the request path:

- a prompt cache (`PromptCache`, LRU bounded in tokens): a prompt seen before is answered on the event loop,
  with its page hashes, at the cost of one dict lookup;
- a pool of ``threads`` worker threads: a missed prompt is queued, and each thread takes every job waiting
  (up to `MAX_BATCH`) and encodes them in one ``encode_batch`` call; results go back to the event loop in one
  callback per batch;
- a conversation's earlier turns: a chat whose first messages are a cached chat's messages, and whose text
  starts with that chat's text, reuses its token ids up to the last added token (``</s>``, ``<|im_end|>``...)
  of that text and encodes only the rest, in context (the added token in front of it, then dropped: text
  after an added token is tokenized on its own, so the ids are those of the whole text; a check on the first
  id guards it). The page hashes of the reused ids are reused too (`PromptTokens.prefix`).

The tokenizer loads in the background at start-up (transformers imports in seconds); until it has loaded every
request is routed by the tree. A prompt longer than ``max_chars`` characters is cut, and its last `CUT_MARGIN`
tokens are dropped (the tokens at a cut may differ from those of the whole text), so its hashes cover a prefix.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pd_cluster.router.kv_index import PromptTokens
from pd_cluster.router.prompt_cache import Cached, PromptCache

log = logging.getLogger("pd_cluster.router.tokenizer")

CUT_MARGIN = 32
"""Tokens dropped after a cut (see the module docstring)."""
MAX_BATCH = 32
"""Jobs one thread encodes in one ``encode_batch`` call at most."""
PREFIX_LOOKBACK = 4
"""A chat of n messages looks for a cached chat of its first n-1 .. n-4 messages."""


@dataclass
class Job:
    """One prompt to tokenize: ``kind`` ``text`` (a completion's prompt), ``ids`` (given token ids) or
    ``chat`` (messages to render); ``key``: its cache key; ``convo``: the chat's message keys."""

    kind: str
    key: Any
    payload: Any
    special: bool
    generation: bool = True
    convo: tuple = ()
    sizes: tuple[int, ...] = ()
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None


class RouterTokenizer:
    """The model's tokenizer (``--tokenizer-path``) behind a prompt cache and a pool of threads.

    Args:
        path: the model or tokenizer folder, as the workers load it.
        max_chars: longer prompts are cut (see the module docstring).
        threads: encoding threads (``--tokenizer-threads``).
        cache_tokens: token ids the prompt cache may hold (``--tokenizer-cache-max-tokens``; 0: no cache).
    """

    def __init__(self, path: str, max_chars: int, threads: int = 2, cache_tokens: int = 1 << 20) -> None:
        self.path = path
        self.max_chars = max_chars
        self.threads = max(1, threads)
        self.cache = PromptCache(cache_tokens)
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._tokenizer: Any = None
        self._backend: Any = None
        self._added: dict[int, str] = {}
        self._workers: list[threading.Thread] = []
        self.reused = 0   # chats whose earlier turns' ids were reused
        self.encoded = 0  # prompts encoded whole
        self.error: str | None = None

    @property
    def loaded(self) -> bool:
        return self._backend is not None

    def start_loading(self) -> None:
        """Load in a background thread, then start the pool; requests before it has loaded get no token ids."""
        threading.Thread(target=self._load_and_start, name="router-tokenizer-load", daemon=True).start()

    def _load_and_start(self) -> None:
        self._load()
        if self.loaded:
            for i in range(self.threads):
                t = threading.Thread(target=self._run, name=f"router-tokenizer-{i}", daemon=True)
                t.start()
                self._workers.append(t)

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            tokenizer.model_max_length = sys.maxsize  # the workers check lengths; no warning per long prompt
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer (no `tokenizers` backend)")
            self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
            self._tokenizer, self._backend = tokenizer, backend
            log.info("router tokenizer loaded", extra={"path": self.path, "threads": self.threads})
        except Exception as exc:  # noqa: BLE001 - routing falls back to the approximate tree
            self.error = repr(exc)
            log.error("router tokenizer failed to load; cache_aware uses the approximate tree",
                      extra={"path": self.path, "reason": self.error})

    def counts(self) -> dict[str, int]:
        """Prompts given token ids so far, by source (``pd_router_tokenizer_prompts_total``)."""
        return {"cache": self.cache.hits, "reused": self.reused, "encoded": self.encoded}

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)

    # ---- on the event loop ------------------------------------------------------------------------------
    async def prompt(self, data: dict[str, Any], chat: bool, page_sizes: Iterable[int] = ()) -> PromptTokens | None:
        """The prompt's token ids (and its page hashes for `page_sizes`), or None when not reproducible or not
        loaded yet."""
        if self._backend is None:
            return None
        job = self._plan(data, chat)
        if job is None:
            return None
        sizes = tuple(page_sizes)
        hit = self.cache.get(job.key)
        if hit is not None:
            for size in sizes:
                hit.prompt.hashes(size)
            return hit.prompt
        loop = asyncio.get_running_loop()
        job.sizes, job.future, job.loop = sizes, loop.create_future(), loop
        self._queue.put(job)
        return await job.future

    def _plan(self, data: dict[str, Any], chat: bool) -> Job | None:
        """What to tokenize, and its cache key; None when the router cannot reproduce the worker's ids."""
        if not chat:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            special = data.get("add_special_tokens", True)
            if isinstance(prompt, str) and isinstance(special, bool):
                # text that is not valid Unicode (a lone surrogate): the worker refuses it with a 400
                return Job("text", ("t", prompt, special), prompt, special) if _unicode(prompt) else None
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                ids = tuple(prompt[:self.max_chars])
                return Job("ids", ("i", ids), ids, False)
            return None
        conversation = _conversation(data)
        if conversation is None:
            return None
        generation, special = data.get("add_generation_prompt", True), data.get("add_special_tokens", False)
        if not isinstance(generation, bool) or not isinstance(special, bool):
            return None
        convo = tuple(_message_key(m) for m in conversation)
        return Job("chat", ("m", convo, generation, special), conversation, special, generation, convo)

    def _deliver(self, done: list[tuple[Job, PromptTokens | None]]) -> None:
        for job, prompt in done:
            if job.future is not None and not job.future.done():
                job.future.set_result(prompt)

    # ---- in the pool's threads --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            while len(batch) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # another thread's stop; ours comes after this batch
                    break
                batch.append(more)
            try:
                done = self._batch(batch)
            except Exception:  # noqa: BLE001 - a tokenizer error: no ids, the tree routes these
                log.exception("router tokenizer batch failed")
                done = [(j, None) for j in batch]
            by_loop: dict[Any, list] = {}
            for j, prompt in done:
                by_loop.setdefault(j.loop, []).append((j, prompt))
            for loop, items in by_loop.items():
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(self._deliver, items)

    def _batch(self, jobs: list[Job]) -> list[tuple[Job, PromptTokens | None]]:
        """Tokenize ``jobs``: render the chats, encode every text in one ``encode_batch`` per special-token flag."""
        plans: list[tuple[Job, str, Cached | None, str]] = []  # (job, text to encode, reused entry, full text)
        for job in jobs:
            if job.kind == "ids":
                plans.append((job, "", None, ""))
                continue
            if job.kind == "text":
                plans.append((job, job.payload, None, job.payload))
                continue
            try:
                text = self._tokenizer.apply_chat_template(job.payload, tokenize=False,
                                                           add_generation_prompt=job.generation)
            except Exception:  # noqa: BLE001 - a template error: the worker will say what is wrong
                plans.append((job, None, None, None))  # type: ignore[arg-type]
                continue
            base = self._earlier_turn(job, text)
            if base is not None:
                plans.append((job, self._added[base.text_ids[base.cut_ids - 1]] + text[base.cut_chars:], base, text))
            else:
                plans.append((job, text, None, text))
        encoded = self._encode_all(plans)
        return [(job, self._finish(job, text, base, full, enc))
                for (job, text, base, full), enc in zip(plans, encoded)]

    def _encode_all(self, plans: list) -> list:
        out: list = [None] * len(plans)
        for special in (True, False):
            picks = [i for i, (job, text, base, _) in enumerate(plans)
                     if text and job.kind != "ids" and (job.kind == "text" and job.special) == special]
            if not picks:
                continue
            texts = [plans[i][1][:self.max_chars] for i in picks]
            for i, enc in zip(picks, self._backend.encode_batch(texts, add_special_tokens=special)):
                out[i] = enc
        return out

    def _finish(self, job: Job, text: str | None, base: Cached | None, full: str | None,
                enc: Any) -> PromptTokens | None:
        if job.kind == "ids":
            prompt = PromptTokens(job.payload)
            entry = Cached(prompt)
            self.encoded += 1
        elif enc is None or text is None:
            return None
        else:
            ids = enc.ids
            cut = len(text) > self.max_chars
            if cut:
                ids = ids[:-CUT_MARGIN]
            shared, start = 0, 0
            if base is None:
                self.encoded += 1
            else:
                if not ids or ids[0] != base.text_ids[base.cut_ids - 1]:  # the added token did not hold: no reuse
                    return self._finish(job, full, None, full, self._backend.encode(full[:self.max_chars],
                                                                                   add_special_tokens=False))
                shared, start = base.cut_ids, base.cut_chars - len(self._added[ids[0]])
                ids = base.text_ids[:shared] + tuple(ids[1:])
                self.reused += 1
            text_ids = tuple(ids)
            cut_chars, cut_ids = (0, 0) if cut or job.kind != "chat" else self._last_cut(enc, start, shared, base)
            bos = self._tokenizer.bos_token_id
            final = (bos,) + text_ids if job.kind == "chat" and job.special and bos is not None else text_ids
            if not final:
                return None
            prompt = PromptTokens(final, prefix=base.prompt if base is not None else None,
                                  shared=shared + len(final) - len(text_ids))
            entry = Cached(prompt, full if job.kind == "chat" else None, text_ids if job.kind == "chat" else (),
                           cut_chars, cut_ids)
        for size in job.sizes:
            prompt.hashes(size)
        prompt.prefix = None  # hashes for today's page sizes are in; keep no chain of turns alive
        if self.cache.max_tokens > 0:
            self.cache.put(job.key, entry)
        return prompt

    def _last_cut(self, enc: Any, start: int, shared: int, base: Cached | None) -> tuple[int, int]:
        """The last added token of an encoded chat text: (characters through it, ids through it)."""
        ids, offsets = enc.ids, enc.offsets
        for i in range(len(ids) - 1, 0 if base is not None else -1, -1):
            if ids[i] in self._added:
                # ``enc`` covers the text from ``start`` (after reuse its first id is the added token in front)
                return start + offsets[i][1], (shared + i) if base is not None else i + 1
        if base is not None:
            return base.cut_chars, base.cut_ids
        return 0, 0

    def _earlier_turn(self, job: Job, text: str) -> Cached | None:
        """A cached chat of this chat's first messages whose text this text continues, with a cut to reuse."""
        n = len(job.convo)
        for k in range(n - 1, max(0, n - 1 - PREFIX_LOOKBACK), -1):
            for generation in (True, False):
                got = self.cache.get(("m", job.convo[:k], generation, job.special), count=False)
                if got is not None and got.cut_ids and got.text is not None and text.startswith(got.text) \
                        and len(text) <= self.max_chars:
                    return got
        return None

    # ---- the same, one request at a time (tests compare it with the worker's /tokenize) ----------------------
    def completion_ids(self, data: dict[str, Any]) -> list[int] | None:
        """A completion's prompt ids, or None (several prompts, or not a prompt)."""
        job = self._plan(data, chat=False)
        return self._one(job) if job is not None else None

    def chat_ids(self, data: dict[str, Any]) -> list[int] | None:
        """A chat's prompt ids through the chat template, or None (tools or parts the router does not render)."""
        job = self._plan(data, chat=True)
        return self._one(job) if job is not None else None

    def _one(self, job: Job) -> list[int] | None:
        (_, prompt), = self._batch([job])
        return list(prompt.token_ids) if prompt is not None else None


def _conversation(data: dict[str, Any]) -> list[dict[str, Any]] | None:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or data.get("tools") or data.get("chat_template_kwargs"):
        return None
    conversation = []
    for m in messages:
        if not isinstance(m, dict) or m.get("tool_calls") or not isinstance(m.get("role"), str):
            return None
        msg = {"role": m["role"], "content": _text(m.get("content"))}
        if msg["content"] is None or not _unicode(msg["content"]) or not _unicode(msg["role"]):
            return None  # parts the router does not render, or text the worker refuses (a lone surrogate)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = m[key]
        conversation.append(msg)
    return conversation


def _unicode(text: str) -> bool:
    """`text` is valid Unicode (no lone UTF-16 surrogate, which the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _message_key(m: dict[str, Any]) -> tuple:
    return (m["role"], m["content"], str(m.get("name")), str(m.get("tool_call_id")))


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
