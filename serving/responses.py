"""OpenAI response bodies and stream chunks, built from the engine's `RequestDelta`s.

Formats follow OpenAI's API reference: ``text_completion`` / ``chat.completion``
objects, ``chat.completion.chunk`` stream chunks (the first carries the
assistant role), a final chunk with ``finish_reason``, and, with
``stream_options.include_usage``, a last chunk with empty ``choices`` and the
``usage``. One builder renders one choice (its ``index``); `merge_choices`
puts several together (``n`` > 1, ``best_of``). A chat choice with tools
(`tool_calls.ChatTools`) renders ``message.tool_calls`` and streams OpenAI's
tool-call deltas.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.engine.outputs import Logprob, RequestDelta
from pd_cluster.serving.prompt_logprobs import PromptEcho, echo_entries, finite, vllm_prompt_logprobs
from pd_cluster.serving.token_text import TokenTexts
from pd_cluster.serving.tools.chat import ChatTools


@dataclass
class ResponseBuilder:
    """Accumulates a request's deltas and renders OpenAI bodies.

    Args:
        kind: ``completion`` or ``chat``.
        request_id: the response id suffix.
        model: the served model name.
        texts: the tokens' strings in context (`TokenTexts`), for logprobs.
        want_logprobs: the request asked for logprobs.
        prompt_token_ids: set when the request asked for ``return_token_ids`` (vLLM): responses then carry
            ``prompt_token_ids`` and ``token_ids``.
        index: the choice's index.
        tools: chat: the request's tools, when the output may hold tool calls.
        prompt: the prompt's side (`PromptEcho`): ``echo``, ``max_tokens`` 0 and vLLM's ``prompt_logprobs``;
            None when the request asked for none of them.
    """

    kind: str
    request_id: str
    model: str
    texts: TokenTexts
    want_logprobs: bool = False
    prompt_token_ids: list[int] | None = None
    index: int = 0
    tools: ChatTools | None = None
    prompt: PromptEcho | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    prompt_lps: list | None = None

    def __post_init__(self) -> None:
        self._tool_stream = self.tools.stream() if self.tools is not None and self.kind == "chat" else None

    @property
    def response_id(self) -> str:
        return ("cmpl-" if self.kind == "completion" else "chatcmpl-") + self.request_id

    def resume(self, text: str) -> None:
        """Continue after the `text` an earlier attempt delivered (``resume_token_ids``): a tool-call stream
        parses on from where it was; nothing of it is sent again. (Logprob strings and offsets go on after
        it through a `TokenTexts` that has taken the resumed tokens.)"""
        if self._tool_stream is not None and text:
            self._tool_stream.feed(text)

    def add(self, d: RequestDelta) -> None:
        """Take one delta (call once per delta, before `chunk`)."""
        if d.prompt_logprobs is not None and self.prompt_lps is None:
            self.prompt_lps = d.prompt_logprobs
        if self.drops_output:  # max_tokens 0: the one token the engine ran is not the client's
            self.prompt_tokens = d.num_prompt_tokens
            self.cached_tokens = max(self.cached_tokens, d.num_cached_tokens)
            if d.finished:
                self.finish_reason = "length" if d.finish_reason in ("length", "stop") else d.finish_reason
            return
        self.text.append(d.new_text)
        self.token_ids.extend(d.new_token_ids)
        if d.new_logprobs:
            self.cumulative_logprob += sum(float(lp[0]) for lp in d.new_logprobs)
        if self.want_logprobs and d.new_logprobs:
            self.entries.extend(self._entry(t, lp) for t, lp in zip(d.new_token_ids, d.new_logprobs))
        self.prompt_tokens, self.completion_tokens = d.num_prompt_tokens, d.num_output_tokens
        self.cached_tokens = max(self.cached_tokens, d.num_cached_tokens)
        if d.finished:
            self.finish_reason = d.finish_reason

    @property
    def drops_output(self) -> bool:
        return self.prompt is not None and self.prompt.drop_output

    def _echo(self) -> tuple[str, list[dict[str, Any]]]:
        """The echoed prompt's text and logprob entries (none without ``echo``)."""
        p = self.prompt
        if p is None or not p.echo:
            return "", []
        if not self.want_logprobs:
            return p.text, []
        return p.text, echo_entries(self.texts.tokenizer, p, self.prompt_lps, self.texts.skip_special)

    def _vllm_prompt_logprobs(self, target: dict[str, Any]) -> None:
        if self.prompt is not None and self.prompt.prompt_top is not None:
            target["prompt_logprobs"] = vllm_prompt_logprobs(self.texts.tokenizer, self.prompt, self.prompt_lps)

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens`` counts prompt tokens whose KV came
        from this worker's prefix cache."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # ---- logprobs ---------------------------------------------------------------------
    def _entry(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        """One token's logprobs: its string in context, offset and bytes, and its top candidates'."""
        chosen_lp, top = lp
        candidates = [(self.texts.candidate(i), finite(v)) for i, v in top]
        tok = self.texts.add(token_id)
        return {"token": tok, "logprob": finite(chosen_lp), "top": candidates}

    def _completion_logprobs(self, entries: list[dict[str, Any]], echoed: int = 0,
                             shift: int = 0) -> dict[str, Any]:
        """OpenAI's completion logprobs; the first `echoed` entries are the prompt's, and the output's offsets
        move by `shift` (the echoed text's length)."""
        top_logprobs: list[dict[str, float] | None] = []
        for e in entries:
            if e["top"] is None:  # the first prompt token: no context, no logprob
                top_logprobs.append(None)
                continue
            top: dict[str, float] = {}
            for c, v in e["top"]:
                top.setdefault(c.text, finite(v))  # two ids may decode to the same string: keep the likelier
            top_logprobs.append(top)
        return {"tokens": [e["token"].text for e in entries],
                "token_logprobs": [None if e["logprob"] is None else finite(e["logprob"]) for e in entries],
                "top_logprobs": top_logprobs,
                "text_offset": [e["token"].offset + (shift if k >= echoed else 0) for k, e in enumerate(entries)]}

    @staticmethod
    def _chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
        def one(t: Any, lp: float) -> dict[str, Any]:
            return {"token": t.text, "logprob": lp, "bytes": list(t.raw)}

        return {"content": [dict(one(e["token"], e["logprob"]), top_logprobs=[one(c, v) for c, v in e["top"]])
                            for e in entries]}

    def _logprobs_for(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.want_logprobs or not entries:
            return None
        if self.kind == "completion":
            return self._completion_logprobs(entries)
        return self._chat_logprobs(entries)

    # ---- whole response -----------------------------------------------------------------
    def full(self) -> dict[str, Any]:
        text = "".join(self.text)
        lps = self._logprobs_for(self.entries)
        if self.kind == "completion":
            echo_text, echoed = self._echo()
            if echo_text or echoed:
                lps = self._completion_logprobs(echoed + self.entries, len(echoed), len(echo_text)) \
                    if self.want_logprobs else None
            choice = {"index": self.index, "text": echo_text + text, "logprobs": lps,
                      "finish_reason": self.finish_reason}
            self._vllm_prompt_logprobs(choice)
            obj = "text_completion"
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = self.finish_reason
            if self.tools is not None and self.tools.active:
                content, calls = self.tools.extract(text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish_reason = self._tool_finish_reason(True)
            choice = {"index": self.index, "message": message, "logprobs": lps, "finish_reason": finish_reason}
            obj = "chat.completion"
        body = {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}
        if self.kind == "chat":
            self._vllm_prompt_logprobs(body)
        self._token_ids(body, choice, self.token_ids, True)
        return body

    def _tool_finish_reason(self, called: bool) -> str | None:
        """``tool_calls`` for an output that ended on its own with calls; ``length`` etc. stay."""
        return "tool_calls" if called and self.finish_reason == "stop" else self.finish_reason

    def _token_ids(self, body: dict[str, Any], choice: dict[str, Any], token_ids: list[int], first: bool) -> None:
        """vLLM's ``return_token_ids``: prompt ids (completions: in the choice; chat: top level) and output ids."""
        if self.prompt_token_ids is None:
            return
        if first:
            (choice if self.kind == "completion" else body)["prompt_token_ids"] = list(self.prompt_token_ids)
        choice["token_ids"] = list(token_ids)

    # ---- stream -------------------------------------------------------------------------
    def chunk(self, d: RequestDelta, first: bool) -> bytes:
        """The SSE event for one delta (the chat stream's first event also carries the role)."""
        n = len(d.new_token_ids) if self.want_logprobs and d.new_logprobs and not self.drops_output else 0
        new = self.entries[len(self.entries) - n:] if n else []
        lps = self._logprobs_for(new)
        if self.kind == "completion":
            echo_text, echoed = self._echo() if first else ("", [])
            if self.prompt is not None and self.prompt.echo and self.want_logprobs and (echoed or new):
                lps = self._completion_logprobs(echoed + new, len(echoed), len(self.prompt.text))
            text = "" if self.drops_output else d.new_text
            reason = self.finish_reason if d.finished and self.drops_output else d.finish_reason
            choice = {"index": self.index, "text": echo_text + text, "logprobs": lps, "finish_reason": reason}
            if first:
                self._vllm_prompt_logprobs(choice)
            obj = "text_completion"
        else:
            if self._tool_stream is not None:
                return self._tool_chunks(d, first, lps)
            delta: dict[str, Any] = {"content": d.new_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": self.index, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}
            obj = "chat.completion.chunk"
        body = {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}
        if first and self.kind == "chat":
            self._vllm_prompt_logprobs(body)
        self._token_ids(body, choice, d.new_token_ids, first)
        return sse(body)

    def _tool_chunks(self, d: RequestDelta, first: bool, lps: dict[str, Any] | None) -> bytes:
        """A chat delta through the choice's `ToolCallStream`: one event per content or tool-call delta (text
        that may be a call is held back), the finish reason on the last; logprobs ride on the first."""
        ts = self._tool_stream
        deltas = ts.feed(d.new_text)
        if d.finished:
            deltas += ts.finish()
        if not deltas and (first or d.finished or lps is not None or self.prompt_token_ids is not None):
            deltas = [{}]
        out = []
        for k, delta in enumerate(deltas):
            delta = dict(delta)
            if first and k == 0:
                delta["role"] = "assistant"
            last = k == len(deltas) - 1
            reason = None
            if last and d.finished:
                reason = "tool_calls" if ts.tools_called and d.finish_reason == "stop" else d.finish_reason
            choice = {"index": self.index, "delta": delta, "logprobs": lps if k == 0 else None,
                      "finish_reason": reason}
            body = {"id": self.response_id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [choice]}
            if k == 0:
                if first:
                    self._vllm_prompt_logprobs(body)
                self._token_ids(body, choice, d.new_token_ids, first)
            out.append(sse(body))
        return b"".join(out)

    def usage_chunk(self) -> bytes:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return sse({"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage()})


def merge_choices(builders: list[ResponseBuilder], extra: list[ResponseBuilder] = (),
                  prompts: list[ResponseBuilder] | None = None) -> dict[str, Any]:
    """One response with every builder's choice, in order (each builder's ``index`` set already).

    ``usage`` counts each prompt once (`prompts`: one builder per prompt of the request; default the first
    builder's) and the completion tokens of `builders` and `extra` (``best_of``'s unreturned sequences were
    generated too)."""
    body = builders[0].full()
    body["choices"] = [b.full()["choices"][0] for b in builders]
    body["usage"] = _summed_usage(prompts or builders[:1], [*builders, *extra])
    return body


def merged_usage_chunk(builders: list[ResponseBuilder], prompts: list[ResponseBuilder] | None = None) -> bytes:
    """The stream's usage chunk for several choices (each prompt counted once, as in `merge_choices`)."""
    b = builders[0]
    obj = "text_completion" if b.kind == "completion" else "chat.completion.chunk"
    return sse({"id": b.response_id, "object": obj, "created": b.created, "model": b.model, "choices": [],
                "usage": _summed_usage(prompts or builders[:1], builders)})


def _summed_usage(prompts: list[ResponseBuilder], generated: list[ResponseBuilder]) -> dict[str, Any]:
    prompt = sum(b.prompt_tokens for b in prompts)
    completion = sum(b.completion_tokens for b in generated)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(b.cached_tokens for b in prompts)}}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
