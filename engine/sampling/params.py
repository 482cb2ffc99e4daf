"""Per-request sampling parameters, in vLLM's `SamplingParams` shape.

Every field is validated at construction (type, finiteness, range, size); a
bad value raises `SamplingParamError` (a `ValueError`) whose message starts with
the field name and whose ``param`` names it, so the servers can answer a 400
naming the parameter (OpenAI's ``param``). Checks that need the model (token ids
against the vocabulary) are in `check_vocab`, which the engine calls at admission.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from pd_cluster.engine.errors import SamplingParamError

if TYPE_CHECKING:
    from pd_cluster.engine.sampling.structured import StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias is in [-100, 100]
PENALTY_RANGE = 2.0  # OpenAI: presence and frequency penalties are in [-2, 2]
MAX_INT32 = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes

LogitsProcessor = Callable[..., Any]
"""``fn(output_token_ids, logits) -> logits`` or ``fn(prompt_token_ids, output_token_ids, logits) -> logits``
(vLLM's offline signatures); ``logits`` is one request's [vocab] float32 row. Offline use only: processors do
not cross a process boundary."""


@dataclass
class SamplingParams:
    """How to generate for one request.

    Attributes:
        n: sequences per prompt, in [1, 128]. The engine generates one sequence per request; a server
            fans ``n > 1`` out into that many requests, and the engine refuses ``n > 1`` itself.
        max_tokens: most tokens to generate (>= 1); None means up to the context length.
        temperature: 0 means greedy; otherwise logits are divided by it. Finite, >= 0.
        top_p: nucleus sampling mass in (0, 1] (Holtzman et al. 2019), within the top-k.
        top_k: keep the k most likely tokens (ties at the k-th value kept); -1 (or 0) disables.
        min_p: drop tokens below min_p times the top probability, in [0, 1].
        presence_penalty: subtracted once from each token already generated, in [-2, 2] (OpenAI).
        frequency_penalty: subtracted per occurrence of each generated token, in [-2, 2] (OpenAI).
        repetition_penalty: > 0; tokens of the prompt or output have positive logits divided and negative
            ones multiplied by it (Keskar et al. 2019, CTRL; transformers' RepetitionPenaltyLogitsProcessor).
        logit_bias: {token id: bias in [-100, 100]} added to the logits (at most 1024 entries); keys may be
            numeric strings, as OpenAI's JSON sends them.
        seed: a per-request seed in torch's range; the same seed gives the same tokens whatever the batch.
        stop: strings that end generation (at most 64, each 1..1024 characters); never emitted partially,
            excluded from the text unless `include_stop_str_in_output`.
        stop_token_ids: token ids that end generation (kept in token_ids); at most 1024.
        ignore_eos: keep generating past the EOS token.
        min_tokens: EOS and stop ids cannot be sampled until this many tokens exist.
        logprobs: return this many top logprobs per generated token (0..20), or None.
        prompt_logprobs: return this many top logprobs per prompt token, or None.
        skip_special_tokens: drop special tokens from the text.
        logits_processors: offline only; callables applied to the request's logits before the rest
            (see `LogitsProcessor`).
        structured_output: a `StructuredOutput` the output must match (JSON schema, JSON object, regex,
            choice, grammar), or its fields as a dict (what ``dataclasses.asdict`` of these params gives, as a
            decode worker sends them to a prefill worker); its token mask applies to every token, after
            penalties and before temperature.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self.stop = self._normalise_stop(self.stop)
        self._check_numbers()
        self._check_penalties()
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in ids):
            raise SamplingParamError("stop_token_ids", f"must be a list of non-negative ints, got {ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        self.stop_token_ids = list(ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamError(name, f"must be an int in [0, {MAX_LOGPROBS}] or null, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(name, f"must be a boolean, got {getattr(self, name)!r}")
        self.logits_processors = self._check_processors(self.logits_processors)
        if self.structured_output is not None:
            from pd_cluster.engine.sampling.structured import StructuredOutput
            if isinstance(self.structured_output, dict):  # `dataclasses.asdict(params)` sent as JSON between workers
                try:
                    self.structured_output = StructuredOutput(**self.structured_output)
                except TypeError as e:
                    raise SamplingParamError("structured_output", f"unknown field: {e}") from None
            if not isinstance(self.structured_output, StructuredOutput):
                raise SamplingParamError("structured_output", "must be a StructuredOutput, got "
                                                              f"{type(self.structured_output).__name__}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingParamError("stop", f"must be a string or a list of strings, got {type(stop).__name__}: {stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if any(s == "" for s in stop):
            raise SamplingParamError("stop", "stop strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise SamplingParamError("stop", f"each stop string has at most {MAX_STOP_STRING_CHARS} characters")
        return list(stop)

    def _check_numbers(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise SamplingParamError("n", f"must be an int in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32):
            raise SamplingParamError("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise SamplingParamError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise SamplingParamError("top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingParamError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise SamplingParamError("seed", f"must be an int in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            raise SamplingParamError("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise SamplingParamError(name, f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise SamplingParamError("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise SamplingParamError("logit_bias", f"must be an object mapping token ids to numbers, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise SamplingParamError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = _token_key(key)
            if token is None:
                raise SamplingParamError("logit_bias", f"keys must be token ids (non-negative ints), got {key!r}")
            if not _is_finite(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise SamplingParamError("logit_bias", f"bias of token {token} must be in "
                                                       f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {value!r}")
            out[token] = out.get(token, 0.0) + float(value)
        return out or None

    @staticmethod
    def _check_processors(processors: object) -> list[LogitsProcessor]:
        if not isinstance(processors, (list, tuple)) or not all(callable(p) for p in processors):
            raise SamplingParamError("logits_processors", "must be a list of callables")
        for p in processors:
            try:
                n = len(inspect.signature(p).parameters)
            except (TypeError, ValueError):
                continue
            if n not in (2, 3):
                raise SamplingParamError("logits_processors", f"a processor takes 2 or 3 arguments, {p!r} takes {n}")
        return list(processors)

    def check_vocab(self, vocab_size: int) -> None:
        """Admission check of token ids against the model's vocabulary.

        Raises:
            SamplingParamError: a ``logit_bias`` key is not below `vocab_size` (``param="logit_bias"``).
        """
        if self.logit_bias:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            if bad:
                raise SamplingParamError("logit_bias", f"token ids {bad[:5]} are outside the vocabulary "
                                                       f"[0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_topk_topp(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def fanned_out(params: SamplingParams) -> list[SamplingParams]:
    """The ``n`` one-sequence params that generate `params`'s ``n`` sequences (the engine runs one per request).

    As in vLLM's servers, a seeded request gives sequence ``i`` the seed ``seed + i`` (wrapping within
    `SEED_RANGE`): the sequences differ, and the same request gives the same sequences again; an unseeded one
    samples each independently.
    """
    out = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed = seed + i if seed + i <= SEED_RANGE[1] else SEED_RANGE[0] + (seed + i - SEED_RANGE[1] - 1)
        out.append(replace(params, n=1, seed=seed))
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _token_key(key: object) -> int | None:
    if _is_int(key):
        return key if 0 <= key <= MAX_INT32 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        value = int(key)
        return value if value <= MAX_INT32 else None
    return None
