"""What the engine hands back: per-step deltas and, offline, vLLM-shaped final outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Logprob = tuple[float, list[tuple[int, float]]]
"""(logprob of the chosen token, [(token id, logprob)] top-N)."""
PromptLogprob = tuple[float, list[tuple[int, float]], int]
"""One prompt position: (logprob of the next prompt token, [(token id, logprob)] top-N, its rank, 1 = likeliest)."""


@dataclass
class RequestDelta:
    """What one step added to one request (streaming servers forward these).

    Attributes:
        new_token_ids: tokens generated this step.
        new_text: text that became final this step (held-back stop-string
            prefixes and incomplete UTF-8 are not included yet).
        new_logprobs: one entry per new token when logprobs were asked.
        finished, finish_reason (``stop``, ``length``, ``abort``, ``error``), stop_reason (the
            stop string or stop token id, else None).
        num_prompt_tokens, num_output_tokens: totals so far (for ``usage``).
        prompt_logprobs: the prompt's logprobs (`PromptLogprob`, one per prompt token after the first), on the
            first streamed delta and on the final one.
        error: with finish_reason ``error``, what failed (this request only; the batch went on).
        num_cached_tokens: prompt tokens whose KV came from the prefix cache (OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``); 0 before admission.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[PromptLogprob] | None = None
    times: Any = None  # engine.request.RequestTimes of a finished request, for metrics
    error: str | None = None
    num_cached_tokens: int = 0


@dataclass
class PrefillProgress:
    """Prefill role: a step wrote the KV of prompt tokens ``[start, end)`` into `block_table` (and, in a hybrid
    pool, `group_tables`: the block tables of KV groups 1.., `pd_cluster.engine.kv.groups`)."""

    request_id: str
    start: int
    end: int
    block_table: list[int]
    done: bool
    group_tables: list[list[int]] = field(default_factory=list)


@dataclass
class StepOutput:
    """Everything one `LLMEngine.step` produced.

    Attributes:
        deltas: per request with news this step.
        prefill_progress: prefill role: the KV written this step, per request.
        reserved: decode role: requests whose prompt pages were just reserved: (request id, the prompt's
            page ids, how many leading ones the prefix cache already held and need no transfer, the block tables
            of KV groups 1.. in a hybrid pool: a windowed group's entries before its window are the null page).
        local_prefills: decode role: ids of remote requests admitted to be prefilled here
            (``--max-local-prefill-length``); no prefill worker is involved.
        num_tokens: tokens the forward pass computed.
    """

    deltas: list[RequestDelta] = field(default_factory=list)
    prefill_progress: list[PrefillProgress] = field(default_factory=list)
    reserved: list[tuple[str, list[int], int, list[list[int]]]] = field(default_factory=list)
    local_prefills: list[str] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """The result of one prompt (vLLM's `RequestOutput`), with shortcuts to the first sequence."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PromptLogprob] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (vLLM's field)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
