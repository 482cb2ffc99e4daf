"""A checkpoint's ``generation_config.json``: the EOS ids that end generation, and default sampling parameters.

vLLM's ``--generation-config {auto,vllm,FOLDER}`` (its ``ModelConfig.get_diff_sampling_param`` and
``SamplingParams.update_from_generation_config``), with its meaning:

- ``auto`` (default): the model folder's ``generation_config.json`` (without one, the generation keys of its
  ``config.json``, as transformers' ``GenerationConfig.from_model_config``). Its ``eos_token_id`` (an int or a
  list) joins the model's EOS ids, and ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``
  and ``max_new_tokens`` (as ``max_tokens``) become the defaults of requests that do not set them.
- ``vllm``: the engine's own sampling defaults. The model folder's EOS ids still end generation (vLLM reads the
  file for them in this mode too: an instruct model must stop at its end-of-turn token whatever the defaults).
- a folder: that folder's ``generation_config.json`` (required), for both; its ``max_new_tokens`` is also an upper
  bound on every request's ``max_tokens`` (vLLM's server-wide limit for an explicit generation config).

Nothing that changes the output is silently dropped. Keys of transformers' ``GenerationConfig`` that select a
decoding algorithm the engine does not run (beam search, contrastive search, DoLa, classifier-free guidance,
constrained beams) are refused at start-up unless they hold their neutral value (``--generation-config vllm``
starts anyway); other keys that transformers' ``generate()`` would apply and the engine does not (``max_length``,
``no_repeat_ngram_size``, ``typical_p``, ``bad_words_ids``, ...) are named in a start-up warning, as is a
``do_sample`` that is not true while sampling defaults are taken (transformers would decode greedily; vLLM, and
so this engine, samples with them). Keys transformers does not know are ignored, as transformers ignores them.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

logger = logging.getLogger("engine")

GENERATION_CONFIG_FILE = "generation_config.json"
MODES = ("auto", "vllm")

SAMPLING_KEYS: tuple[tuple[str, str], ...] = (
    ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_tokens"))
"""(key of the file, `SamplingParams` field): vLLM's list of defaults taken from a generation config."""

NO_EFFECT = frozenset({
    "bos_token_id", "pad_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "return_dict_in_generate",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits", "renormalize_logits",
    "remove_invalid_values", "compile_config", "disable_compile", "prefill_chunk_size",
    "continuous_batching_config", "low_memory", "num_return_sequences", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
    "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind", "target_lookbehind"})
"""Keys that do not change the tokens of one sequence (ids of other special tokens, caches, what
``generate()`` returns, assisted decoding that keeps the output, the number of sequences: a request's ``n``)."""

BEAM_ONLY = frozenset({"length_penalty", "early_stopping", "diversity_penalty"})
"""Keys that act only under beam search (refused by `ALGORITHMS` when that is asked for)."""

ALGORITHMS: dict[str, Any] = {"num_beams": 1, "num_beam_groups": 1, "penalty_alpha": 0, "dola_layers": None,
                              "guidance_scale": 1, "constraints": None, "force_words_ids": None}
"""Decoding algorithms the engine does not run, with the neutral value of their key: refused otherwise."""

NEUTRAL: dict[str, Any] = {"min_length": 0, "min_new_tokens": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                           "eta_cutoff": 0.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                           "encoder_no_repeat_ngram_size": 0}
"""Neutral values of keys that change the output otherwise (besides None, false and empty lists)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What one engine takes from a generation config.

    Attributes:
        mode: ``auto``, ``vllm`` or the folder given to ``--generation-config``.
        source: the file read (``generation_config.json`` or, without one, ``config.json``), or None.
        eos_token_ids: the file's ``eos_token_id`` (the engine adds config.json's and the tokenizer's).
        sampling: `SamplingParams` fields the file sets (``max_new_tokens`` as ``max_tokens``); empty under
            ``vllm``. A request that sets a field keeps its own value.
        max_tokens_cap: ``max_tokens`` also bounds every request's (an explicit folder, as vLLM).
        not_applied: ``(key, value)`` of keys transformers would apply and the engine does not (warned).
    """

    mode: str = "vllm"
    source: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    sampling: Mapping[str, Any] = field(default_factory=dict, hash=False)
    max_tokens_cap: bool = False
    not_applied: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling", MappingProxyType(dict(self.sampling)))  # read-only, as the rest

    @property
    def default_max_tokens(self) -> int | None:
        return self.sampling.get("max_tokens")

    def resolve_max_tokens(self, requested: int | None, room: int) -> int | None:
        """A request's ``max_tokens``: its own, else the default (at most `room`, the tokens its prompt leaves in
        the context, so that a default the request never asked for cannot make it too long); under
        `max_tokens_cap` at most the default. None: up to the context length (the engine fills it).
        """
        default = self.default_max_tokens
        if default is None:
            return requested
        if requested is None:
            return max(min(default, room), 1)
        return min(requested, default) if self.max_tokens_cap else requested

    def pick(self, name: str, value: Any, engine_default: Any) -> Any:
        """A request's value of sampling field `name`: its own when set (not None), else this config's default,
        else `engine_default`."""
        if value is not None:
            return value
        return self.sampling.get(name, engine_default)

    def log(self, all_eos_ids: tuple[int, ...]) -> None:
        """The start-up lines: which fields were taken (vLLM's line), the EOS ids, the keys not applied."""
        if self.sampling:
            taken = ", ".join(f"{k}={v!r}" for k, v in self.sampling.items())
            logger.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                           "config recommended from the model creator (%s): %s. If this is not intended, please "
                           "relaunch with `--generation-config vllm`.", self.source, taken)
            if self.max_tokens_cap:
                logger.warning("max_new_tokens=%d from %s bounds every request's max_tokens",
                               self.sampling["max_tokens"], self.source)
        if self.source is not None:
            logger.info("EOS token ids %s end generation (generation config %s: eos_token_id %s; --generation-config "
                        "%s)", list(all_eos_ids), self.source, list(self.eos_token_ids), self.mode)
        if self.not_applied:
            logger.warning("%s: not applied (vLLM ignores them too; transformers' generate() would apply them): %s",
                           self.source, ", ".join(f"{k}={v!r}" for k, v in self.not_applied))


def load_generation_config(mode: str, model_path: str | Path) -> GenerationDefaults:
    """Read the generation config that ``--generation-config`` `mode` names for the model in `model_path`.

    Raises:
        ValueError: a folder without ``generation_config.json``, a file that is not a JSON object, a taken key
            with a bad value, or a decoding algorithm the engine does not run (each named, with the file).
    """
    folder = Path(model_path if mode in MODES else mode).expanduser()
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if mode not in MODES:
            raise ValueError(f"--generation-config {mode}: no {GENERATION_CONFIG_FILE} in that folder")
        path = folder / "config.json"  # transformers' GenerationConfig.from_model_config
        if not path.is_file():
            return GenerationDefaults(mode)
        cfg = _read(path)
        cfg = {k: v for k, v in cfg.items() if k in _transformers_keys()}
    else:
        cfg = _read(path)
    eos = _eos_ids(cfg.get("eos_token_id"), path)
    if mode == "vllm":
        return GenerationDefaults(mode, str(path), eos)
    sampling = {name: cfg[key] for key, name in SAMPLING_KEYS if cfg.get(key) is not None}
    _check_sampling(sampling, path)
    _check_algorithms(cfg, path)
    not_applied = _not_applied(cfg, sampling)
    return GenerationDefaults(mode, str(path), eos, sampling, max_tokens_cap=mode not in MODES and
                              "max_tokens" in sampling, not_applied=not_applied)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def _eos_ids(value: Any, path: Path) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{path}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return tuple(sorted(set(ids)))


def _check_sampling(sampling: dict[str, Any], path: Path) -> None:
    """The ranges of `SamplingParams` (transformers' ``top_k`` 0 disables, as the engine's does)."""
    rules = {
        "temperature": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
        "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "in (0, 1]"),
        "top_k": (lambda v: _is_int(v) and v >= -1, "an int >= 0 (0 or -1: disabled)"),
        "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "in [0, 1]"),
        "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
        "max_tokens": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    }
    for name, value in sampling.items():
        ok, what = rules[name]
        if not ok(value):
            key = "max_new_tokens" if name == "max_tokens" else name
            raise ValueError(f"{path}: {key} must be {what}, got {value!r}")


def _check_algorithms(cfg: dict[str, Any], path: Path) -> None:
    for key, neutral in ALGORITHMS.items():
        value = cfg.get(key)
        if not _is_neutral(value, neutral):
            raise ValueError(
                f"{path}: {key}={value!r} asks transformers' generate() for a decoding algorithm this engine does "
                f"not run (it samples one sequence per request, greedily at temperature 0). vLLM ignores the key; "
                f"pd-cluster refuses it rather than change the output silently. Start with --generation-config vllm "
                f"to use the engine's defaults (the file's EOS ids still apply), or point --generation-config at a "
                f"folder whose {GENERATION_CONFIG_FILE} has no {key}.")


def _not_applied(cfg: dict[str, Any], sampling: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Keys transformers knows and would apply with their value, which the engine does not apply."""
    known = _transformers_keys()
    taken = {key for key, _ in SAMPLING_KEYS} | {"eos_token_id", "do_sample"}
    out = []
    for key, value in cfg.items():
        if key not in known or key in taken or key in NO_EFFECT or key in BEAM_ONLY or key in ALGORITHMS:
            continue
        if not _is_neutral(value, NEUTRAL.get(key)):
            out.append((key, value))
    if cfg.get("do_sample") is not True and sampling.keys() & {"temperature", "top_p", "top_k", "min_p"}:
        out.append(("do_sample", cfg.get("do_sample")))  # transformers: greedy; vLLM samples with the defaults
    return tuple(out)


def _is_neutral(value: Any, neutral: Any) -> bool:
    if value is None or value is False or value == [] or value == {}:
        return True
    return neutral is not None and not isinstance(value, bool) and value == neutral


@functools.cache
def _transformers_keys() -> frozenset[str]:
    """The keys of transformers' ``GenerationConfig`` (the installed version's)."""
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
