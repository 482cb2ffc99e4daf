"""OpenAI request bodies (completions and chat completions) and their mapping to `SamplingParams`.

Field names and defaults follow OpenAI's API reference; the extras that vLLM
and SGLang accept (``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``) are accepted too. Torch-free.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_cluster.engine.errors import RequestRejected


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM / SGLang extras
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _unsupported(self) -> None:
        if self.n != 1:
            raise RequestRejected("n: only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestRejected(f"{name}: only 0 is supported", param=name)
        if self.logit_bias:
            raise RequestRejected("logit_bias: not supported", param="logit_bias")

    def _sampling_kwargs(self) -> dict[str, Any]:
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids).

        Raises:
            RequestRejected: several prompts, an empty list, or unsupported options.
        """
        self._unsupported()
        if self.echo:
            raise RequestRejected("echo: not supported", param="echo")
        if self.suffix:
            raise RequestRejected("suffix: not supported", param="suffix")
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise RequestRejected("prompt: must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise RequestRejected("prompt: only one prompt per request is supported", param="prompt")

    def sampling_kwargs(self) -> dict[str, Any]:
        return dict(self._sampling_kwargs(), max_tokens=self.max_tokens, logprobs=self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestRejected(f"messages: content part type {part.get('type')!r} is not supported",
                                      param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        """Messages as plain dicts for the chat template.

        Raises:
            RequestRejected: no messages or unsupported options.
        """
        self._unsupported()
        if not self.messages:
            raise RequestRejected("messages: must contain at least one message", param="messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_kwargs(self) -> dict[str, Any]:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestRejected("top_logprobs: requires logprobs=true", param="top_logprobs")
        n_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return dict(self._sampling_kwargs(), max_tokens=limit, logprobs=n_logprobs)
