"""`SpeculativeConfig`: which drafter proposes tokens and how many, with SGLang's flag names and vLLM's JSON.

SGLang: ``--speculative-algorithm NGRAM --speculative-num-draft-tokens K``
(``--speculative-ngram-min-match-window-size``, ``--speculative-ngram-max-match-window-size``), or
``--speculative-algorithm STANDALONE --speculative-draft-model-path PATH``.
vLLM: ``--speculative-config '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
"prompt_lookup_max": 4}'`` (``{"method": "draft_model", "model": PATH}`` for a draft model). Both build the same
frozen config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN")
LATER_ALGORITHMS = ("EAGLE", "EAGLE3")
"""Algorithms SGLang names that this engine does not run yet: refused at start-up by name."""

DEFAULT_NUM_DRAFT_TOKENS = 4
NEXTN_DEFAULT_STEPS = 3
"""NEXTN's K without flags: SGLang's automatic choice for DeepSeek-V3 (``--speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4``)."""
DEFAULT_MIN_MATCH = 1
DEFAULT_MAX_MATCH = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings of one engine.

    Attributes:
        speculative_algorithm: None (off), ``NGRAM`` (prompt lookup: the draft continues the latest earlier
            occurrence of the sequence's last n tokens; no draft model) or ``STANDALONE`` (a separate small draft
            model with the target's vocabulary proposes K tokens greedily, with its own paged KV) or ``NEXTN``
            (DeepSeek-V3's multi-token-prediction layer in the target checkpoint, fed the target's hidden state,
            chained K times; `pd_cluster.engine.spec.nextn`).
        speculative_num_draft_tokens: NGRAM, STANDALONE: K, the draft tokens proposed and verified per request
            and step; a step emits 1 to K + 1 tokens. Default 4. NEXTN: SGLang's meaning, the tokens verified per
            step counting the verified (last known) token, so K = N - 1 (N >= 2); default K = 3, SGLang's choice
            for DeepSeek-V3.
        speculative_ngram_min_match_window_size: the shortest suffix looked up (vLLM's ``prompt_lookup_min``).
        speculative_ngram_max_match_window_size: the longest suffix looked up, tried first (``prompt_lookup_max``).
        speculative_draft_model_path: STANDALONE: the draft model's checkpoint folder (vLLM's ``model``).
        speculative_num_steps: STANDALONE, NEXTN: SGLang's chain length N; sets K = N (then
            ``--speculative-num-draft-tokens``, if given, must be N + 1: SGLang counts the verified token there).
        speculative_eagle_topk: SGLang's drafts per step; only 1 (a chain) is built.

    Raises:
        ValueError: an unknown algorithm, one not built yet (EAGLE, EAGLE3), K < 1, bad match windows, STANDALONE
            without a draft model folder (or with one that has no config.json), or a draft model with another
            algorithm; each message names the flag and the value.
    """

    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int = DEFAULT_MIN_MATCH
    speculative_ngram_max_match_window_size: int = DEFAULT_MAX_MATCH
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None

    def __post_init__(self) -> None:
        given = algo = self.speculative_algorithm
        if algo is not None:
            algo = str(algo).upper()
            object.__setattr__(self, "speculative_algorithm", algo)
            if algo in LATER_ALGORITHMS:
                raise ValueError(f"--speculative-algorithm {algo} is not supported yet; supported: "
                                 f"{', '.join(ALGORITHMS)}")
            if algo not in ALGORITHMS:
                raise ValueError(f"--speculative-algorithm {given!r} is unknown; "
                                 f"choose from {', '.join(ALGORITHMS)}")
        elif self.speculative_num_draft_tokens is not None:
            raise ValueError("--speculative-num-draft-tokens needs --speculative-algorithm")
        k = self.speculative_num_draft_tokens
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {k!r}")
        if algo == "NEXTN" and k == 1:
            raise ValueError("--speculative-num-draft-tokens 1 with --speculative-algorithm NEXTN drafts nothing: "
                             "with NEXTN it counts the verified token too (SGLang's meaning), so it must be >= 2")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if lo < 1:
            raise ValueError(f"--speculative-ngram-min-match-window-size must be >= 1, got {lo}")
        if hi < lo:
            raise ValueError(f"--speculative-ngram-max-match-window-size ({hi}) must be >= "
                             f"--speculative-ngram-min-match-window-size ({lo})")
        self._check_draft_model(algo)
        self._check_steps(algo)

    def _check_steps(self, algo: str | None) -> None:
        """SGLang's chain flags: ``--speculative-num-steps N`` drafts N tokens (K = N); with them SGLang's
        ``--speculative-num-draft-tokens`` counts the verified token too (N + 1, top-k 1)."""
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        if topk is not None and topk != 1:
            raise ValueError(f"--speculative-eagle-topk {topk} is not supported: drafts are one chain (top-k 1)")
        if steps is None:
            return
        if algo not in ("STANDALONE", "NEXTN"):
            raise ValueError(f"--speculative-num-steps is used with --speculative-algorithm STANDALONE or NEXTN, "
                             f"got {algo}")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {steps!r}")
        given = self.speculative_num_draft_tokens
        if given is not None and given != steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens {given} with --speculative-num-steps {steps}: with "
                             f"steps given it counts the verified token too (SGLang's rule at top-k 1), so it must "
                             f"be {steps + 1}")

    def _check_draft_model(self, algo: str | None) -> None:
        path = self.speculative_draft_model_path
        if algo == "STANDALONE" and not path:
            raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path (the draft "
                             "model's checkpoint folder)")
        if path and algo != "STANDALONE":
            raise ValueError(f"--speculative-draft-model-path is only used with --speculative-algorithm STANDALONE, "
                             f"got {algo}")
        if path and not (Path(path) / "config.json").is_file():
            raise ValueError(f"--speculative-draft-model-path {path!r} is not a checkpoint folder (no config.json)")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def num_draft_tokens(self) -> int:
        """K, the drafts per request and step: ``--speculative-num-steps`` when given; else NEXTN:
        ``--speculative-num-draft-tokens`` - 1 (SGLang counts the verified token), default 3; other algorithms:
        ``--speculative-num-draft-tokens``, default 4."""
        if self.speculative_num_steps:
            return self.speculative_num_steps
        given = self.speculative_num_draft_tokens
        if self.speculative_algorithm == "NEXTN":
            return given - 1 if given else NEXTN_DEFAULT_STEPS
        return given or DEFAULT_NUM_DRAFT_TOKENS

    def handshake(self) -> dict[str, Any]:
        """What a PD worker advertises about speculation at the KV transfer handshake (``GET /kv_transfer/info``,
        compared by `pd_cluster.transfer.layout.check_compatible`): ``speculative``, the settings (`describe`),
        and ``draft_state``, the drafter's state that crosses the transfer beside the target's KV (sent by the
        prefill, expected by the decode). A pair whose ``draft_state`` differs is refused at the handshake, naming
        both sides' settings; settings that differ otherwise are logged, not refused.

        ``draft_state`` is empty for every algorithm and role here: the prefill worker sends the target's KV and
        first token only and the decode worker computes its drafter's state itself (NGRAM: none; STANDALONE: the
        draft model's KV of the prompt; NEXTN: the MTP layer's entries from its first decode step on). So the
        decode's speculative settings never need anything from the prefill's, unlike vLLM, whose KV cache holds
        the draft layers and whose P and D must run the same speculative config."""
        return {"speculative": self.describe(), "draft_state": []}

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.enabled:
            return "off"
        if self.speculative_algorithm == "STANDALONE":
            return f"STANDALONE k={self.num_draft_tokens} draft model {self.speculative_draft_model_path}"
        if self.speculative_algorithm == "NEXTN":
            return f"NEXTN k={self.num_draft_tokens} (the checkpoint's multi-token-prediction layer)"
        return (f"{self.speculative_algorithm} k={self.num_draft_tokens} match window "
                f"{self.speculative_ngram_min_match_window_size}..{self.speculative_ngram_max_match_window_size}")


_VLLM_KEYS = {"method": "speculative_algorithm", "num_speculative_tokens": "speculative_num_draft_tokens",
              "prompt_lookup_min": "speculative_ngram_min_match_window_size",
              "prompt_lookup_max": "speculative_ngram_max_match_window_size",
              "model": "speculative_draft_model_path"}


def parse_speculative_config(text: str | dict) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON as `SpeculativeConfig` fields.

    Raises:
        ValueError: not a JSON object, or a key this engine does not honour (named).
    """
    if isinstance(text, dict):
        data = text
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_VLLM_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config keys not supported: {', '.join(unknown)} "
                         f"(supported: {', '.join(_VLLM_KEYS)})")
    out = {_VLLM_KEYS[k]: v for k, v in data.items()}
    if "speculative_algorithm" in out and isinstance(out["speculative_algorithm"], str):
        method = out["speculative_algorithm"].lower()
        out["speculative_algorithm"] = {"ngram": "NGRAM", "draft_model": "STANDALONE", "mtp": "NEXTN",
                                        "deepseek_mtp": "NEXTN"}.get(method, method)
    if out.get("speculative_algorithm") == "NEXTN" and "speculative_num_draft_tokens" in out:
        # vLLM's num_speculative_tokens is K itself; SGLang's NEXTN draft-token count includes the verified one
        out["speculative_num_steps"] = out.pop("speculative_num_draft_tokens")
    return out
