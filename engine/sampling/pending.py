"""A step's sampling as issued on the device, read back later (`PendingSample`), and its host result.

Overlap scheduling (SGLang's overlap scheduler, vLLM v1's async scheduling) issues step N+1 before
reading step N's tokens: the ids stay on the device for N+1's inputs and reach the host through one
non-blocking copy into pinned memory, waited on only when N's results are processed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.sampling.params import SamplingParams

Logprob = tuple[float, list[tuple[int, float]]]
PromptLogprob = tuple[float, list[tuple[int, float]], int]
"""A prompt position: (logprob of the next prompt token, [(token id, logprob)] top-N, that token's rank)."""


@dataclass
class SamplerOutput:
    """Result of sampling one step.

    Attributes:
        token_ids: per row, the chosen token, or -1 for a row that failed.
        logprobs: per row, None or (chosen token's logprob, [(token_id, logprob)] top-N),
            computed from the model's raw distribution (before any processing, vLLM's default).
        errors: per row, None or why the row could not be sampled (the request fails, the batch goes on).
    """

    token_ids: list[int]
    logprobs: list[Logprob | None]
    errors: list[str | None]



@dataclass
class DeviceLogprobs:
    """Logprobs of `rows` on the device: the chosen token's [R] and the top-N values and ids [R, N]."""

    rows: list[int]
    chosen: torch.Tensor
    top_vals: torch.Tensor
    top_ids: torch.Tensor

    def start_copy(self) -> None:
        """On CUDA: copy the three tensors to pinned host memory without waiting (`to_host` reads those once
        the caller's event has completed); a `.tolist()` of device tensors would wait for every later kernel."""
        self.chosen, self.top_vals, self.top_ids = (_pinned_copy(t) for t in (self.chosen, self.top_vals,
                                                                               self.top_ids))

    def to_host(self, params: list[SamplingParams]) -> list[Logprob | None]:
        """Per row of the step (None for rows not in `rows`): (chosen logprob, [(token id, logprob)] top-N).
        Reads the pinned copies after `start_copy` (the caller waited for its event), else the device tensors."""
        out: list[Logprob | None] = [None] * len(params)
        chosen, top_vals, top_ids = self.chosen.tolist(), self.top_vals.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.rows):
            n = params[i].logprobs
            out[i] = (chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
        return out


class PendingSample:
    """A step's sampling, issued on the device and read back by `result` (overlap scheduling's future).

    Attributes:
        token_ids: [B] int64 on the device, the chosen ids (a failed row holds some valid id; `result` says -1).
    """

    def __init__(self, token_ids: torch.Tensor, bad: torch.Tensor, errors: list[str | None],
                 params: list[SamplingParams]) -> None:
        self.token_ids = token_ids
        self._bad = bad
        self._errors = errors
        self._params = params
        self.logprobs: DeviceLogprobs | None = None
        self.fallback_logprobs: list[Logprob | None] | None = None
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._result: SamplerOutput | None = None

    def host_tokens(self) -> list[int]:
        """The chosen ids as a list (waits for the device: only the row-by-row logprobs fallback uses it)."""
        return self.token_ids.tolist()

    def _flags(self) -> torch.Tensor:
        """[2, B] int64: the chosen ids and the rows with nothing to sample from."""
        return torch.stack([self.token_ids, self._bad.to(self.token_ids.dtype)])

    def start_copy(self) -> None:
        """On CUDA: start the ids' and flags' copy to pinned host memory (no sync); elsewhere nothing."""
        if self.token_ids.device.type != "cuda":
            return
        self._host = _pinned_copy(self._flags())
        if self.logprobs is not None:
            self.logprobs.start_copy()
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> SamplerOutput:
        """Wait for the device and return the tokens (-1 for failed rows), logprobs and errors."""
        if self._result is not None:
            return self._result
        if self._copied is not None:
            self._copied.synchronize()
            tokens, bad = self._host.tolist()
        else:
            tokens, bad = self._flags().tolist()
        errors = self._errors
        for i, is_bad in enumerate(bad):
            if is_bad and errors[i] is None:
                errors[i] = "the logits hold no finite value to sample from (NaN or every token banned)"
        for i, e in enumerate(errors):
            if e is not None:
                tokens[i] = -1
        if self.fallback_logprobs is not None:
            logprobs = self.fallback_logprobs
        elif self.logprobs is not None:
            logprobs = self.logprobs.to_host(self._params)
        else:
            logprobs = [None] * len(tokens)
        logprobs = [None if tokens[i] < 0 else lp for i, lp in enumerate(logprobs)]
        self._result = SamplerOutput(tokens, logprobs, errors)
        return self._result


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that `t` (on CUDA) is being copied into (complete once an event recorded after
    this call has)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
