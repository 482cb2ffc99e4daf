"""Per-request sampling parameters, in vLLM's `SamplingParams` shape.

Every field is validated at construction; a bad value raises `ValueError`
whose message starts with the field name, so the servers can answer a 400
naming the parameter (OpenAI's ``param``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamError(ValueError):
    """A sampling parameter is invalid. `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    """How to generate for one request.

    Attributes:
        max_tokens: most tokens to generate (>= 1); None means up to the context length.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019).
        top_k: keep the k most likely tokens; -1 (or 0) disables.
        min_p: drop tokens below min_p times the top probability, in [0, 1].
        seed: a per-request seed; the same seed gives the same tokens whatever the batch.
        stop: strings that end generation; never emitted partially, excluded from
            the text unless `include_stop_str_in_output`.
        stop_token_ids: token ids that end generation (kept in token_ids).
        ignore_eos: keep generating past the EOS token.
        min_tokens: EOS and stop ids are ignored until this many tokens exist.
        logprobs: return this many top logprobs per generated token (0..20), or None.
        prompt_logprobs: return this many top logprobs per prompt token, or None.
        skip_special_tokens: drop special tokens from the text.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.stop = self._normalise_stop(self.stop)
        self._check_numbers()
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise SamplingParamError("stop_token_ids", f"must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamError(name, f"must be an int in [0, {MAX_LOGPROBS}] or null, got {value!r}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingParamError("stop", f"must be a string or a list of strings, got {type(stop).__name__}: {stop!r}")
        if any(s == "" for s in stop):
            raise SamplingParamError("stop", "stop strings must not be empty")
        return list(stop)

    def _check_numbers(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamError("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise SamplingParamError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamError("top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingParamError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamError("seed", f"must be an int, got {self.seed!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SamplingParamError("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_topk_topp(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
