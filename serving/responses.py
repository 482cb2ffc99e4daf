"""OpenAI response bodies and stream chunks, built from the engine's `RequestDelta`s.

Formats follow OpenAI's API reference: ``text_completion`` / ``chat.completion``
objects, ``chat.completion.chunk`` stream chunks (the first carries the
assistant role), a final chunk with ``finish_reason``, and, with
``stream_options.include_usage``, a last chunk with empty ``choices`` and the
``usage``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.engine.outputs import Logprob, RequestDelta


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class ResponseBuilder:
    """Accumulates a request's deltas and renders OpenAI bodies.

    Args:
        kind: ``completion`` or ``chat``.
        request_id: the response id suffix.
        model: the served model name.
        tokenizer: for token strings in logprobs.
        want_logprobs: the request asked for logprobs.
    """

    kind: str
    request_id: str
    model: str
    tokenizer: Any
    want_logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    _text_offset: int = 0

    @property
    def response_id(self) -> str:
        return ("cmpl-" if self.kind == "completion" else "chatcmpl-") + self.request_id

    def add(self, d: RequestDelta) -> None:
        self.text.append(d.new_text)
        self.token_ids.extend(d.new_token_ids)
        if d.new_logprobs:
            self.logprobs.extend(d.new_logprobs)
        self.prompt_tokens, self.completion_tokens = d.num_prompt_tokens, d.num_output_tokens
        if d.finished:
            self.finish_reason = d.finish_reason

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    # ---- logprobs ---------------------------------------------------------------------
    def _completion_logprobs(self, token_ids: list[int], lps: list[Logprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for t in token_ids:
            offsets.append(self._text_offset)
            s = _token_text(self.tokenizer, t)
            tokens.append(s)
            self._text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{_token_text(self.tokenizer, i): v for i, v in top} for _, top in lps],
                "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], lps: list[Logprob]) -> dict[str, Any]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = _token_text(self.tokenizer, tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in top])
                            for t, (lp, top) in zip(token_ids, lps)]}

    def _logprobs_for(self, token_ids: list[int], lps: list[Logprob] | None) -> dict[str, Any] | None:
        if not self.want_logprobs or not lps:
            return None
        if self.kind == "completion":
            return self._completion_logprobs(token_ids, lps)
        return self._chat_logprobs(token_ids, lps)

    # ---- whole response -----------------------------------------------------------------
    def full(self) -> dict[str, Any]:
        text = "".join(self.text)
        lps = self._logprobs_for(self.token_ids, self.logprobs)
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": self.finish_reason}
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                      "finish_reason": self.finish_reason}
            obj = "chat.completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    # ---- stream -------------------------------------------------------------------------
    def chunk(self, d: RequestDelta, first: bool) -> bytes:
        """The SSE event for one delta (the chat stream's first event also carries the role)."""
        lps = self._logprobs_for(d.new_token_ids, d.new_logprobs)
        if self.kind == "completion":
            choice = {"index": 0, "text": d.new_text, "logprobs": lps, "finish_reason": d.finish_reason}
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"content": d.new_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}
            obj = "chat.completion.chunk"
        return sse({"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [choice]})

    def usage_chunk(self) -> bytes:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse({"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage()})


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
