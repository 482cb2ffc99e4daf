"""A request inside the engine: its tokens, progress, pages and state.

As in vLLM v1 there is no separate prefill or decode phase: a request has
`num_tokens` known tokens (prompt plus generated) of which `num_computed_tokens`
already have KV in the pool; each step computes some of the rest. A request
that starts on a cached prefix starts with `num_computed_tokens` at its length.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pd_cluster.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pd_cluster.engine.sampling.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"                  # queued for admission (pages)
    WAITING_FOR_REMOTE_KV = "waiting_kv"  # decode role: pages reserved, KV arriving
    RUNNING = "running"                  # in the batch
    PREFILLED = "prefilled"              # prefill role: first token out, pages held for the transfer
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"             # this request failed (e.g. its sampling); the others went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class RequestTimes:
    """Monotonic timestamps (seconds, `time.monotonic`) of a request's life, for metrics."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None        # pages first granted
    first_scheduled: float | None = None
    prefill_done: float | None = None    # last prompt chunk computed (or remote KV complete)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    # decode role: where the remote part of the time went (seconds), reported by the prefill worker
    remote_queue_s: float | None = None
    remote_prefill_s: float | None = None
    kv_wait_s: float | None = None  # pages reserved (ticket made) to all pushes arrived

    @property
    def transfer_s(self) -> float | None:
        """The handover: the KV wait not spent queueing or computing at the prefill worker."""
        if self.kv_wait_s is None:
            return None
        return max(self.kv_wait_s - (self.remote_queue_s or 0.0) - (self.remote_prefill_s or 0.0), 0.0)


GROUP_SEPARATOR = "."
"""A server fans one client request out into engine requests named ``<client request id>.<suffix>`` (one per prompt
and choice; `pd_cluster.serving.openai_serving`), and a prefill worker's job keeps its decode worker's id."""


def request_group(request_id: str) -> str:
    """The client request an engine request id belongs to: the id before its last `GROUP_SEPARATOR`, or the whole
    id when it has none (an offline request is its own group)."""
    head, sep, _ = request_id.rpartition(GROUP_SEPARATOR)
    return head if sep else request_id


VARIANT_OFFSET = 1 << 31  # above every vocabulary, within the uint32 the KV events hash


class VariantTokens(Sequence):
    """A read-only view of `ids` with `offset` added to each id (`Request.cache_tokens`)."""

    def __init__(self, ids: list[int], offset: int) -> None:
        self.ids, self.offset = ids, offset

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [t + self.offset for t in self.ids[i]]
        return self.ids[i] + self.offset


class Request:
    """One generation request.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt's tokens.
        params: sampling parameters.
        eos_token_ids: the model's EOS ids (ignored with ``ignore_eos``).
        remote_kv: decode role: the prompt's KV comes from a prefill worker.
        resumed_output_ids: output tokens generated (and delivered) before this request started, e.g. by a
            worker that died mid-stream: they count as output (``max_tokens``, ``min_tokens``, penalties) and
            their KV is computed with the prompt's; generation continues after them.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), remote_kv: bool = False,
                 resumed_output_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.remote_kv = remote_kv
        self.token_ids: list[int] = list(prompt_token_ids) + list(resumed_output_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_resumed_tokens = len(resumed_output_ids)
        self.num_computed_tokens = 0
        self.num_inflight = 0  # overlap scheduling: tokens sampled by launched steps, not yet known on the host
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
        self.block_table: list[int] = []
        self.group_tables: list[list[int]] = []  # KV groups 1.. of a hybrid pool (block_table is group 0's)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        self.grammar: RequestGrammar | None = None  # structured output: the matcher, fed every output token
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] = []  # `PromptLogprob`s
        self.num_retractions = 0
        self.rope_variant = 0  # longrope: 1 while its KV is rotated by the long factors (`make_request`, `Scheduler`)
        self.times = RequestTimes()

    @property
    def group(self) -> str:
        """The client request this sequence belongs to (`request_group`): the scheduler interleaves groups."""
        return request_group(self.request_id)

    @property
    def num_tokens(self) -> int:
        """Tokens the scheduler counts: the known ones plus those in flight (`num_inflight`, overlap scheduling)."""
        return len(self.token_ids) + self.num_inflight

    @property
    def cache_tokens(self) -> Sequence[int]:
        """The prefix cache's key of this request's tokens: its token ids, or for KV rotated by longrope's long
        factors (`rope_variant` 1) the same ids moved past every vocabulary (``id + 2**31``), so that pages
        rotated one way never serve a request rotated the other."""
        return self.token_ids if not self.rope_variant else VariantTokens(self.token_ids, VARIANT_OFFSET)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known on the host (those in flight excluded)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        """Resolved output limit (the engine fills `params.max_tokens` when it is None)."""
        assert self.params.max_tokens is not None
        return self.params.max_tokens

    @property
    def remaining_output_tokens(self) -> int:
        return max(self.max_tokens - self.num_output_tokens, 0)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop after appending a token: EOS, stop ids, or max_tokens.

        Stop strings are checked by the output processor, which owns the text.
        """
        n_out = self.num_output_tokens
        last = self.token_ids[-1]
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pages={len(self.block_table)})")
