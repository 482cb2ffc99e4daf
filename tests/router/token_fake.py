"""A deterministic token-level fake decode for migration tests (``pd_fake --token-model``).

Each next token id is a fixed function of the context (all ids so far), so a
request continued after its generated ids (``resume_token_ids``, as the real
workers take it) on another worker produces exactly what an undisturbed run
would: the property greedy decoding has on real workers. Resumed ids count as
output (``max_tokens``, usage) and are not sent again. It speaks vLLM's ``return_token_ids``: the first chunk
carries ``prompt_token_ids`` (on the choice for completions, at the top level
for chat) and every choice carries the ``token_ids`` it adds. Token ``t``
reads ``" t<id>"``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

VOCAB = 997


def prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
    """Token ids of the prompt: a list of ids as is, else one id per word."""
    if chat:
        text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in body.get("messages") or []
                       if isinstance(m, dict))
        return [1] + [sum(w.encode()) % VOCAB + 3 for w in text.split()]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return [1] + [sum(w.encode()) % VOCAB + 3 for w in str(prompt).split()]


def next_id(context: list[int]) -> int:
    """The greedy token after ``context`` (depends on the last two ids and the length)."""
    a = context[-1]
    b = context[-2] if len(context) > 1 else 0
    return (a * 31 + b * 7 + len(context) * 17) % VOCAB + 3


def piece(token: int) -> str:
    return f" t{token}"


class TokenModel:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` of one fake decode worker."""

    def __init__(self, server) -> None:
        self.server = server  # the PdFakeServer: config (ttft, itl), counters, recent
        self._held: dict[str, int] = {}  # request id -> pages held

    async def handle(self, req, resp, rid: str) -> None:
        c = self.server.config
        body = json.loads(req.body)
        chat = req.path == "/v1/chat/completions"
        ids = prompt_ids(body, chat)
        limit = body.get("max_completion_tokens") if chat else None
        limit = limit if limit is not None else body.get("max_tokens")
        n = limit if isinstance(limit, int) else (16 if not chat else 32)
        resumed = [t for t in body.get("resume_token_ids") or [] if isinstance(t, int)]
        want_ids = body.get("return_token_ids") is True
        stream = bool(body.get("stream"))
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        self.server.recent.append({"request_id": rid, "path": req.path, "status": 200,
                                   "headers": req.headers, "prompt": body.get("prompt"),
                                   "max_tokens": limit, "return_token_ids": want_ids,
                                   "resume_token_ids": resumed})
        head = {"id": f"cmpl-{rid}", "object": "chat.completion.chunk" if chat else
                "text_completion", "created": int(time.time()), "model": c.model}
        hdrs = [("x-request-id", rid), ("content-type", "text/event-stream" if stream
                                         else "application/json")]
        self.server._running += 1
        self._held[rid] = 0
        self._hold(rid, len(ids))
        try:
            await self._run(req, resp, chat, ids, resumed, n, want_ids, stream, usage_wanted, head,
                            hdrs, rid)
        finally:
            self.server._running -= 1
            self.server._used_pages -= self._held.pop(rid)

    def _hold(self, rid: str, tokens: int) -> None:
        """Pages for ``tokens`` tokens of request ``rid`` (counted in the fake's ``/get_load``)."""
        need = -(-tokens // self.server.config.page_size)
        self.server._used_pages += need - self._held[rid]
        self._held[rid] = need

    async def _run(self, req, resp, chat, ids, resumed, n, want_ids, stream, usage_wanted, head,
                   hdrs, rid) -> None:
        c = self.server.config
        context = list(ids) + resumed
        out: list[int] = list(resumed)
        t0 = req.arrival
        for i in range(n - len(resumed)):
            delay = t0 + (c.ttft_ms + i * c.itl_ms) / 1000.0 - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if resp.closed:
                return
            tok = next_id(context)
            context.append(tok)
            out.append(tok)
            self._hold(rid, len(context))
            if not stream:
                continue
            data = _sse(self._chunk(head, chat, piece(tok), [tok], None, want_ids,
                                    ids if i == 0 else None))
            if i == 0:
                first = _sse(self._chunk(head, chat, None, None, None, False, None)) if chat else b""
                resp.start_stream(200, hdrs, first + data)
            else:
                resp.write(data)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                 "total_tokens": len(ids) + len(out)}
        if not stream:
            text = "".join(piece(t) for t in out)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat
                          else {"text": text})
            full = dict(head, object="chat.completion" if chat else "text_completion",
                        choices=[choice], usage=usage)
            if want_ids:
                choice["token_ids"] = out
                if chat:
                    full["prompt_token_ids"] = ids
                else:
                    choice["prompt_token_ids"] = ids
            resp.send(200, json.dumps(full).encode(), hdrs)
            return
        tail = _sse(self._chunk(head, chat, "", [] if want_ids else None, "length", want_ids, None))
        if usage_wanted:
            tail += _sse(dict(head, choices=[], usage=usage))
        resp.end_stream(tail + b"data: [DONE]\n\n")

    @staticmethod
    def _chunk(head, chat, text, token_ids, finish, want_ids, prompt) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["delta"] = {"role": "assistant", "content": ""} if text is None else (
                {"content": text} if text else {})
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        event = dict(head, choices=[choice])
        if want_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        if want_ids and prompt is not None:
            if chat:
                event["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        return event


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
