"""Engine flags with SGLang's names, and the conversion to `EngineConfig`.

One table (`ENGINE_FLAGS`) drives both the command line (`add_engine_args`)
and the keyword arguments of `LLM(...)` (`config_from_kwargs`), so the two can
not drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from pd_cluster.engine.config import (KV_CACHE_DTYPES, ROLES, CacheConfig, DeviceConfig, EngineConfig, ModelConfig,
                           ParallelConfig, SchedulerConfig, parse_size)


def _kv_dtype(text: str) -> str:
    aliases = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16"}
    value = aliases.get(text, text)
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(KV_CACHE_DTYPES)}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


@dataclass(frozen=True)
class Flag:
    """One engine flag: its name, the config section and field it sets, its type and help."""

    name: str
    section: str
    field: str
    type: Callable[[str], Any] | None
    help: str
    action: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model", "model", str, "HF checkpoint folder (default: the embedded stories260K)."),
    Flag("--tokenizer", "model", "tokenizer", str, "Tokenizer folder (default: the model's)."),
    Flag("--dtype", "model", "dtype", str, "Weights/activations dtype: auto, float32, bfloat16, float16."),
    Flag("--load-format", "model", "load_format", str, "auto (safetensors) or dummy (random weights).",
         choices=("auto", "safetensors", "dummy")),
    Flag("--served-model-name", "model", "served_model_name", str, "Model name in the API (default: folder name)."),
    Flag("--seed", "model", "seed", int, "Seed of dummy weights and of unseeded sampling."),
    Flag("--page-size", "cache", "page_size", int, "Tokens per KV page, 1..256 (default 64)."),
    Flag("--kv-cache-dtype", "cache", "kv_cache_dtype", _kv_dtype, "auto, bf16, fp16, fp32 or fp8_e4m3."),
    Flag("--mem-fraction-static", "cache", "mem_fraction_static", float,
         "GPU: fraction of device memory for weights + KV pool (default 0.88)."),
    Flag("--kv-cache-memory", "cache", "kv_cache_memory", _size,
         "Bytes for the KV pool, e.g. 2GiB (CPU default 256MiB; on GPU overrides --mem-fraction-static)."),
    Flag("--num-pages", "cache", "num_pages", int, "Exact number of KV pages (overrides the budgets)."),
    Flag("--disable-radix-cache", "cache", "disable_radix_cache", None, "Turn the prefix cache off.",
         action="store_true"),
    Flag("--no-enable-prefix-caching", "cache", "disable_radix_cache", None, "Alias of --disable-radix-cache.",
         action="store_true"),
    Flag("--context-length", "scheduler", "context_length", int,
         "Longest prompt + output accepted (default: the model's). Never sizes the pool."),
    Flag("--chunked-prefill-size", "scheduler", "chunked_prefill_size", int, "Most prompt tokens per request per step."),
    Flag("--max-prefill-tokens", "scheduler", "max_prefill_tokens", int, "Token budget of one step."),
    Flag("--max-running-requests", "scheduler", "max_running_requests", int, "Most requests in the running batch."),
    Flag("--max-queued-requests", "scheduler", "max_queued_requests", int, "Waiting requests before 503s."),
    Flag("--schedule-conservativeness", "scheduler", "schedule_conservativeness", float,
         "Scales the new-token reservation (>1: fewer retractions)."),
    Flag("--schedule-policy", "scheduler", "schedule_policy", str, "Queue order: fcfs.", choices=("fcfs",)),
    Flag("--decode-log-interval", "scheduler", "decode_log_interval", int, "Decode steps between log lines."),
    Flag("--tp-size", "parallel", "tp_size", int, "Tensor-parallel size."),
    Flag("--device", "device", "device", str, "auto, cpu or cuda[:N]."),
    Flag("--attention-backend", "device", "attention_backend", str, "auto, torch, cpu or triton.",
         choices=("auto", "torch", "cpu", "triton")),
    Flag("--disable-cuda-graph", "device", "disable_cuda_graph", None, "Do not replay CUDA graphs.",
         action="store_true"),
    Flag("--cuda-graph-max-bs", "device", "cuda_graph_max_bs", int, "Largest decode batch captured in a graph."),
    Flag("--cpu-threads", "device", "cpu_threads", int, "Intra-op threads on CPU (default 1)."),
)

_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig, "device": DeviceConfig}


def add_engine_args(parser: argparse.ArgumentParser, include_role: bool = False) -> argparse.ArgumentParser:
    """Add every engine flag to `parser` (defaults None: the config's defaults apply)."""
    group = parser.add_argument_group("engine")
    for f in ENGINE_FLAGS:
        kwargs: dict[str, Any] = {"dest": f.dest, "help": f.help, "default": None}
        if f.action:
            kwargs["action"] = f.action
        else:
            kwargs["type"] = f.type
        if f.choices:
            kwargs["choices"] = f.choices
        group.add_argument(f.name, **kwargs)
    if include_role:
        group.add_argument("--role", choices=ROLES, default=None, help="prefill, decode or mixed.")
    return parser


def config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """Build an `EngineConfig` from flag names as keywords (``page_size=16``); None means default.

    Raises:
        TypeError: an unknown keyword.
        ValueError: an invalid value (from the config dataclasses).
    """
    by_dest = {f.dest: f for f in ENGINE_FLAGS}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    role = kwargs.pop("role", None)
    for key, value in kwargs.items():
        if key not in by_dest:
            raise TypeError(f"unknown engine argument {key!r}; known: {sorted(by_dest)}")
        if value is None or value is False:
            continue
        f = by_dest[key]
        if f.field == "kv_cache_memory":
            value = parse_size(value)
        elif f.field == "kv_cache_dtype":
            value = _kv_dtype(value)
        sections[f.section][f.field] = value
    built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
    return EngineConfig(**built, **({"role": role} if role else {}))


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Build an `EngineConfig` from parsed flags (see `add_engine_args`)."""
    values = {f.dest: getattr(ns, f.dest, None) for f in ENGINE_FLAGS}
    return config_from_kwargs(role=getattr(ns, "role", None), **values)
