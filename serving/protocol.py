"""OpenAI request bodies (completions and chat completions) and their mapping to `SamplingParams`.

Field names, defaults and ranges follow OpenAI's API reference; the extras that
vLLM and SGLang accept (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``add_special_tokens``, ``return_token_ids``,
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``)
are accepted too. Sampling fields a request does not set take the generation config's defaults
(``--generation-config``). ``response_format`` and the ``guided_*`` fields become a
`StructuredOutput`; chat ``tools`` / ``tool_choice`` are validated here and
enforced or parsed by `tools/chat.py`. Nothing that changes the output is ignored: a field is
honoured, or refused with a 400 naming it (`fields.py` lists which).
Types are strict (``"5"`` is not an int). Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_cluster.common.request_limits import too_many_sequences
from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.model.generation_config import GenerationDefaults
from pd_cluster.engine.sampling.params import MAX_LOGPROBS, MAX_N, SamplingParams
from pd_cluster.engine.sampling.structured import structured_output_from_request
from pd_cluster.serving.fields import check_extra_fields

MAX_STOP = 16
"""Most stop strings per request."""
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
NO_DEFAULTS = GenerationDefaults()
"""No generation config: the engine's own defaults (``--generation-config vllm`` without EOS ids)."""
_INT64 = 2 ** 63

StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, lt=2 ** 31)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM / SGLang extras
    top_k: int | None = Field(-1, ge=-1, lt=2 ** 31)
    min_p: float | None = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(1.0, gt=0, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=2 ** 31)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM: logprobs of every prompt token
    # structured outputs (OpenAI, and vLLM's extras); validated by `structured_output_from_request`
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    # pd-cluster: continue a stream after output already delivered (the router's request migration): one list,
    # or with several choices one list per choice (index order), null for a choice that already finished
    resume_token_ids: list[TokenId] | list[list[TokenId] | None] | None = None

    # ---- what the engine does with them ----------------------------------------------------
    def _check_extras(self) -> None:
        check_extra_fields(self.model_extra or {}, "chat" if isinstance(self, ChatCompletionRequest) else "completion")

    def _sampling_kwargs(self, defaults: GenerationDefaults) -> dict[str, Any]:
        """`SamplingParams` fields; `defaults` (the generation config, ``--generation-config``) fill the sampling
        fields the request does not set (an explicit value, ``temperature: 1.0`` included, wins)."""
        kw: dict[str, Any] = dict(
            temperature=defaults.pick("temperature", self.temperature, 1.0),
            top_p=defaults.pick("top_p", self.top_p, 1.0),
            top_k=defaults.pick("top_k", self._given("top_k"), -1),
            min_p=defaults.pick("min_p", self._given("min_p"), 0.0), seed=self.seed,
            stop=self.stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, prompt_logprobs=self.prompt_logprobs,
            structured_output=structured_output_from_request(
                self.response_format, self.guided_json, self.guided_regex, self.guided_choice,
                self.guided_grammar, self.guided_whitespace_pattern))
        kw.update(self._penalties(defaults))
        return kw

    def _given(self, name: str) -> Any:
        """The request's value of `name`, or None when the body does not set it (its model default aside)."""
        return getattr(self, name) if name in self.model_fields_set else None

    def _penalties(self, defaults: GenerationDefaults) -> dict[str, Any]:
        """Penalties and logit bias for `SamplingParams`, refused by name where the engine lacks the field."""
        wanted: dict[str, Any] = {}
        repetition = defaults.pick("repetition_penalty", self._given("repetition_penalty"), 1.0)
        for name, value, default in (("presence_penalty", self.presence_penalty, 0.0),
                                     ("frequency_penalty", self.frequency_penalty, 0.0),
                                     ("repetition_penalty", repetition, 1.0)):
            if value is not None and value != default:
                wanted[name] = value
        if self.logit_bias:
            try:
                wanted["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise RequestRejected("logit_bias: keys must be token ids (integers as strings)",
                                      param="logit_bias", code="invalid_value") from e
        for name in wanted:
            if name not in _SAMPLING_FIELDS:
                raise RequestRejected(f"{name}: not supported by this server yet", param=name,
                                      code="unsupported_parameter")
        return wanted

    def resumed_output(self) -> list[list[int] | None]:
        """``resume_token_ids`` per choice: output tokens generated and delivered by an earlier attempt of this
        stream ([] when absent; `pd_cluster.serving.resume.prepare_resumed_choices` checks the count).

        Generation continues after them as if this server had generated them: they count toward ``max_tokens``,
        ``min_tokens``, penalties and ``usage.completion_tokens``; a grammar and a seeded generator replay them;
        their text is not sent again. With one choice, one list; with several (``n`` > 1, several prompts), one
        list per choice in index order, ``null`` for a choice that already finished (it is not generated again).

        Raises:
            RequestRejected: with ``stream`` false, with ``best_of`` above ``n``, or one flat list for several
                choices.
        """
        ids = self.resume_token_ids
        if not ids:
            return []
        if not self.stream:
            raise RequestRejected("resume_token_ids: only with stream=true", param="resume_token_ids",
                                  code="unsupported_parameter")
        if self.num_generated > self.num_choices:
            raise RequestRejected("resume_token_ids: not with best_of above n", param="resume_token_ids",
                                  code="unsupported_parameter")
        if all(isinstance(t, int) for t in ids):
            return [list(ids)]  # type: ignore[arg-type]
        return [None if x is None else list(x) for x in ids]  # type: ignore[union-attr]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        """``n``: the choices returned."""
        return self.n or 1

    @property
    def num_generated(self) -> int:
        """The sequences generated: ``best_of`` (completions) or ``n``."""
        return self.num_choices


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | list[TokenId] | list[
        list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, lt=2 ** 31)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompts (texts or token ids), in order: one, or several (``prompt`` as a list of strings or of
        token-id lists, as OpenAI and vLLM accept); each becomes its own requests.

        Raises:
            RequestRejected: an empty prompt, or a field that is not supported.
        """
        self._check_extras()
        if self.best_of is not None and self.best_of < self.num_choices:
            raise RequestRejected(f"best_of: must be >= n ({self.num_choices}), got {self.best_of}",
                                  param="best_of", code="invalid_value")
        if self.stream and self.num_generated > self.num_choices:
            raise RequestRejected("best_of: streaming is not supported when best_of > n", param="best_of",
                                  code="unsupported_parameter")
        if self.max_tokens == 0 and not self.echo:
            raise RequestRejected("max_tokens: 0 is only valid with echo=true (it scores the prompt without "
                                  "generating)", param="max_tokens", code="invalid_value")
        if self.suffix:
            raise RequestRejected("suffix: not supported", param="suffix", code="unsupported_parameter")
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif not p:
            raise RequestRejected("prompt: must not be empty", param="prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = [x if isinstance(x, str) else list(x) for x in p]
        for i, x in enumerate(prompts):
            if not x:
                raise RequestRejected("prompt: must not be empty", param="prompt" if len(prompts) == 1 else
                                      f"prompt[{i}]")
        if (message := too_many_sequences(len(prompts), self.num_generated)) is not None:
            raise RequestRejected(message, param="prompt", code="invalid_value")
        return prompts

    def sampling_kwargs(self, defaults: GenerationDefaults = NO_DEFAULTS) -> dict[str, Any]:
        """`SamplingParams` fields (``max_tokens`` as sent: `GenerationDefaults.resolve_max_tokens` applies the
        default once the prompt's length is known). ``max_tokens`` 0 (``echo``: score the prompt) runs one token,
        which the response drops; ``echo`` with ``logprobs`` asks the engine for that many prompt logprobs."""
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return dict(self._sampling_kwargs(defaults), max_tokens=1 if self.max_tokens == 0 else self.max_tokens,
                    logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """``max_tokens`` 0 with ``echo``: the prompt alone is returned (its generated token is dropped)."""
        return self.max_tokens == 0

    @property
    def num_generated(self) -> int:
        return max(self.best_of or 1, self.num_choices)

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"


MEDIA_PARTS = ("image_url", "input_image", "input_audio", "video_url", "file")
"""Chat content part types that carry media (OpenAI's and vLLM's names): refused by name."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template takes it (tool calls' arguments as objects, as transformers
        documents for ``apply_chat_template``)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return msg

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") in MEDIA_PARTS:
                raise RequestRejected(f"messages[{index}].content[{j}]: {part['type']} input is not supported: the "
                                      f"server runs a language model on text (a multimodal checkpoint's language "
                                      f"model alone); send parts of type 'text'",
                                      param=f"messages[{index}].content[{j}]", code="unsupported_parameter")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestRejected(f"messages[{index}].content[{j}]: only parts of type 'text' with a string "
                                      f"'text' are supported", param=f"messages[{index}].content[{j}]",
                                      code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, lt=2 ** 31)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2 ** 31)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template.

        Raises:
            RequestRejected: a field or message part that is not supported.
        """
        self._check_extras()
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def sampling_kwargs(self, defaults: GenerationDefaults = NO_DEFAULTS) -> dict[str, Any]:
        """`SamplingParams` fields (``max_tokens`` as sent, see `CompletionRequest.sampling_kwargs`)."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestRejected("top_logprobs: requires logprobs=true", param="top_logprobs")
        n_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return dict(self._sampling_kwargs(defaults), max_tokens=limit, logprobs=n_logprobs)

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return dict(call, function=dict(fn, arguments=args))


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[TokenId]
