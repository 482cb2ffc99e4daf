"""Engine flags with SGLang's names, and the conversion to `EngineConfig`.

One table (`ENGINE_FLAGS`, rows of `pd_cluster.common.flags.Flag`) drives both the command line
(`add_engine_args`) and the keyword arguments of `LLM(...)` (`config_from_kwargs`), so the two can
not drift apart.

Spellings users paste from vLLM and SGLang are aliases where the meaning is ours too:
``--model-path`` (SGLang) is ``--model``, ``--tokenizer-path`` (SGLang) is ``--tokenizer``,
``--max-model-len`` (vLLM) is ``--context-length``, ``--random-seed`` (SGLang) is ``--seed``,
``--tensor-parallel-size`` (both) is ``--tp-size``. ``--trust-remote-code`` is accepted and changes nothing:
pd-cluster never runs code shipped with a checkpoint (its models are built in, its tokenizer is
``tokenizer.json`` through `transformers`), so there is nothing to trust. ``--gpu-memory-utilization`` is
refused: vLLM's fraction budgets the whole instance (activations and CUDA graphs included), ours
(``--mem-fraction-static``, SGLang's) budgets weights and the KV pool only.
"""

from __future__ import annotations

import argparse
from typing import Any

from pd_cluster.engine.config import (KV_CACHE_DTYPES, ROLES, STORAGE_BACKENDS, STORAGE_PREFETCH_POLICIES, CacheConfig,
                                      DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                      parse_size)
from pd_cluster.common.flags import Flag, Refused, add_flags
from pd_cluster.engine.spec.config import SpeculativeConfig, parse_speculative_config


def _kv_dtype(text: str) -> str:
    aliases = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16"}
    value = aliases.get(text, text)
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(KV_CACHE_DTYPES)}")
    return value


def parse_hicache_size(text: str) -> int | None:
    """SGLang's ``--hicache-size``: a bare number is GB (10**9 bytes), 0 is unset (the ratio applies); a size
    with a unit (``512MiB``) is that size. ``LLM(hicache_size=...)`` takes an int as bytes."""
    if str(text).strip().replace(".", "", 1).isdigit():
        return int(float(text) * 10**9) or None
    return parse_size(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model.model", str, "HF checkpoint folder (default: the embedded stories260K).",
         aliases=("--model-path",)),
    Flag("--tokenizer", "model.tokenizer", str, "Tokenizer folder (default: the model's).",
         aliases=("--tokenizer-path",)),
    Flag("--dtype", "model.dtype", str, "Weights/activations dtype: auto, float32, bfloat16, float16."),
    Flag("--load-format", "model.load_format", str, "auto (safetensors) or dummy (random weights).",
         choices=("auto", "safetensors", "dummy")),
    Flag("--served-model-name", "model.served_model_name", str, "Model name in the API (default: folder name)."),
    Flag("--seed", "model.seed", int, "Seed of dummy weights and of unseeded sampling.",
         aliases=("--random-seed",)),
    Flag("--generation-config", "model.generation_config", str,
         "auto (default): the model's generation_config.json gives EOS ids and default sampling parameters; "
         "vllm: the engine's defaults (its EOS ids still stop); or a folder to read generation_config.json from."),
    Flag("--page-size", "cache.page_size", int, "Tokens per KV page, 1..256 (default 64)."),
    Flag("--kv-cache-dtype", "cache.kv_cache_dtype", _kv_dtype, "auto, bf16, fp16, fp32 or fp8_e4m3."),
    Flag("--mem-fraction-static", "cache.mem_fraction_static", float,
         "GPU: fraction of device memory for weights + KV pool (default 0.88)."),
    Flag("--kv-cache-memory", "cache.kv_cache_memory", _size,
         "Bytes for the KV pool, e.g. 2GiB (CPU default 256MiB; on GPU overrides --mem-fraction-static)."),
    Flag("--num-pages", "cache.num_pages", int, "Exact number of KV pages (overrides the budgets)."),
    Flag("--disable-radix-cache", "cache.disable_radix_cache", None, "Turn the prefix cache off.",
         action="store_true", aliases=("--no-enable-prefix-caching",)),
    Flag("--enable-hierarchical-cache", "cache.enable_hierarchical_cache", None,
         "Keep evicted prefix-cache pages in a host-memory tier and load them back on a hit (off by default).",
         action="store_true"),
    Flag("--hicache-ratio", "cache.hicache_ratio", float, "Host tier size over device pool size (default 2.0)."),
    Flag("--hicache-size", "cache.hicache_size", parse_hicache_size,
         "Host tier size: a bare number is GB (SGLang's), or a size such as 512MiB; overrides --hicache-ratio."),
    Flag("--hicache-storage-backend", "cache.hicache_storage_backend", str,
         "A cluster-wide KV store behind the prefix cache (HiCache L3): mooncake (Mooncake Store) or file "
         "(a directory); every worker reads it on a miss and writes what it computes.", choices=STORAGE_BACKENDS),
    Flag("--hicache-storage-backend-extra-config", "cache.hicache_storage_backend_extra_config", str,
         "JSON settings of the store, e.g. '{\"master_server_address\": \"10.0.0.1:50051\"}' "
         "(docs/kv-store.md)."),
    Flag("--hicache-storage-prefetch-policy", "cache.hicache_storage_prefetch_policy", str,
         "When a request stops waiting for its pages from the store: timeout (default), best_effort, "
         "wait_complete.", choices=STORAGE_PREFETCH_POLICIES),
    Flag("--hicache-storage-required", "cache.hicache_storage_required", None,
         "Refuse to start when the store cannot be reached (default: warn and serve without it).",
         action="store_true"),
    Flag("--disable-hybrid-kv-cache-manager", "cache.disable_hybrid_kv_cache_manager", None,
         "Keep every layer's KV for every token, also on sliding-window/chunked layers (one KV group).",
         action="store_true"),
    Flag("--context-length", "scheduler.context_length", int,
         "Longest prompt + output accepted (default: the model's). Never sizes the pool.",
         aliases=("--max-model-len",)),
    Flag("--chunked-prefill-size", "scheduler.chunked_prefill_size", int, "Most prompt tokens per request per step."),
    Flag("--max-prefill-tokens", "scheduler.max_prefill_tokens", int, "Token budget of one step."),
    Flag("--max-running-requests", "scheduler.max_running_requests", int, "Most requests in the running batch."),
    Flag("--max-queued-requests", "scheduler.max_queued_requests", int, "Waiting requests before 503s."),
    Flag("--schedule-conservativeness", "scheduler.schedule_conservativeness", float,
         "Scales the new-token reservation (>1: fewer retractions)."),
    Flag("--schedule-policy", "scheduler.schedule_policy", str, "Queue order: fcfs.", choices=("fcfs",)),
    Flag("--decode-log-interval", "scheduler.decode_log_interval", int, "Decode steps between log lines."),
    Flag("--max-local-prefill-length", "scheduler.max_local_prefill_length", int,
         "Decode role: prefill here, without a prefill worker, when the prompt's tokens not in this worker's "
         "prefix cache are at most this many (Dynamo's conditional disaggregation; default 0: never)."),
    Flag("--tp-size", "parallel.tp_size", int, "Tensor-parallel size.", aliases=("--tensor-parallel-size",)),
    Flag("--prefill-context-parallel-size", "parallel.prefill_context_parallel_size", int,
         "Context-parallel prefill (vLLM's flag): ranks that split each prompt chunk (zig-zag) and all-gather "
         "its K/V per layer; --tp-size 1, mixed or prefill role (docs/long-context-10m.md).", aliases=("-pcp",)),
    Flag("--enable-expert-parallel", "parallel.enable_expert_parallel", None,
         "MoE layers: each TP rank holds whole experts (E / tp-size) instead of a slice of every expert (vLLM's flag).",
         action="store_true"),
    Flag("--ep-num-redundant-experts", "parallel.ep_num_redundant_experts", int,
         "EPLB (SGLang's flag): extra physical experts over the expert-parallel ranks, replicas of the busiest "
         "(E + this a multiple of the EP size; needs --enable-expert-parallel)."),
    Flag("--enable-eplb", "parallel.enable_eplb", None,
         "EPLB (SGLang's flag): record each MoE layer's expert load and rebalance the experts over the ranks every "
         "--eplb-rebalance-num-iterations steps.", action="store_true"),
    Flag("--eplb-rebalance-num-iterations", "parallel.eplb_rebalance_num_iterations", int,
         "EPLB: steps between two rebalances (default 1000)."),
    Flag("--dp-size", "parallel.dp_size", int,
         "Data-parallel attention ranks (with --enable-dp-attention; --tp-size / --dp-size ranks each).",
         aliases=("--data-parallel-size",)),
    Flag("--enable-dp-attention", "parallel.enable_dp_attention", None,
         "Data-parallel attention (SGLang's flag): each DP rank its own requests and KV pool, attention weights "
         "whole; MoE layers gather every rank's tokens.", action="store_true"),
    Flag("--nnodes", "parallel.nnodes", int,
         "Nodes one instance spans (SGLang's flag): --tp-size / --nnodes ranks on each; default 1, or "
         "LWS_GROUP_SIZE in a LeaderWorkerSet pod."),
    Flag("--node-rank", "parallel.node_rank", int,
         "This node's rank, 0 .. nnodes-1: node 0 serves the instance, the others run only their ranks (default 0, "
         "or LWS_WORKER_INDEX)."),
    Flag("--dist-init-addr", "parallel.dist_init_addr", str,
         "HOST:PORT of node 0 where every node's ranks meet (default with LWS: LWS_LEADER_ADDRESS:20000)."),
    Flag("--dist-timeout", "parallel.dist_timeout", int,
         "Seconds the ranks have to meet before start-up fails (default 120 on one node, 600 over several)."),
    Flag("--device", "device.device", str, "auto, cpu or cuda[:N]."),
    Flag("--attention-backend", "device.attention_backend", str, "auto, torch, cpu or triton.",
         choices=("auto", "torch", "cpu", "triton")),
    Flag("--disable-cuda-graph", "device.disable_cuda_graph", None, "Do not replay CUDA graphs.",
         action="store_true"),
    Flag("--cuda-graph-max-bs", "device.cuda_graph_max_bs", int, "Largest decode batch captured in a graph."),
    Flag("--disable-overlap-schedule", "device.disable_overlap_schedule", None,
         "Schedule each step after the previous one's tokens reach the host (overlap is on by default on CUDA).",
         action="store_true"),
    Flag("--enable-overlap-schedule", "device.enable_overlap_schedule", None,
         "Overlap scheduling also on CPU (no gain there; exercises the CUDA path's bookkeeping).",
         action="store_true"),
    Flag("--cpu-threads", "device.cpu_threads", int, "Intra-op threads on CPU (default 1)."),
    Flag("--speculative-algorithm", "speculative.speculative_algorithm", str,
         "Speculative decoding: NGRAM (prompt lookup drafts), STANDALONE (a draft model) or NEXTN (DeepSeek-V3's "
         "multi-token-prediction layer in the checkpoint), verified losslessly "
         "(docs/speculative-decoding.md)."),
    Flag("--speculative-draft-model-path", "speculative.speculative_draft_model_path", str,
         "STANDALONE: the draft model's checkpoint folder (the target's vocabulary; run on decode and mixed "
         "workers)."),
    Flag("--speculative-num-draft-tokens", "speculative.speculative_num_draft_tokens", int,
         "Draft tokens proposed and verified per request and step (default 4); NEXTN: SGLang's count, the "
         "verified token included (N - 1 drafts; default 4: 3 drafts)."),
    Flag("--speculative-num-steps", "speculative.speculative_num_steps", int,
         "STANDALONE, NEXTN: SGLang's chain length N (K = N drafts; --speculative-num-draft-tokens, if given, "
         "must then be N + 1 as in SGLang)."),
    Flag("--speculative-eagle-topk", "speculative.speculative_eagle_topk", int,
         "SGLang's drafts per step: only 1 (a chain)."),
    Flag("--speculative-ngram-min-match-window-size", "speculative.speculative_ngram_min_match_window_size", int,
         "NGRAM: the shortest suffix looked up (default 1)."),
    Flag("--speculative-ngram-max-match-window-size", "speculative.speculative_ngram_max_match_window_size", int,
         "NGRAM: the longest suffix looked up, tried first (default 4)."),
    Flag("--speculative-config", "speculative.speculative_config", str,
         "vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'."),
    Flag("--trust-remote-code", "compat.trust_remote_code", None,
         "Accepted for vLLM/SGLang command lines; no effect: no code from a checkpoint is ever run.",
         action="store_true"),
)

# Spellings of vLLM/SGLang whose meaning differs from any flag of ours: refused with the reason.
REFUSED_FLAGS: tuple[Refused, ...] = (
    Refused("--gpu-memory-utilization", "vLLM's fraction covers the whole instance; pd-cluster's "
            "--mem-fraction-static (SGLang's) covers weights + KV pool only, or set --kv-cache-memory"),
)
COMPAT_ONLY = ("--trust-remote-code",)  # accepted so pasted command lines run; they change nothing

_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig, "device": DeviceConfig, "speculative": SpeculativeConfig}


def add_engine_args(parser: argparse.ArgumentParser, include_role: bool = False) -> argparse.ArgumentParser:
    """Add every engine flag to `parser` (defaults None: the config's defaults apply)."""
    group = parser.add_argument_group("engine")
    add_flags(group, ENGINE_FLAGS + REFUSED_FLAGS)
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
        if f.section == "compat":
            continue
        if f.attr == "kv_cache_memory":
            value = parse_size(value)
        elif f.attr == "hicache_size" and not isinstance(value, int):
            value = parse_hicache_size(value)
        elif f.attr == "kv_cache_dtype":
            value = _kv_dtype(value)
        elif f.attr == "speculative_config":
            _merge_speculative_config(sections["speculative"], value)
            continue
        sections[f.section][f.attr] = value
    built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
    return EngineConfig(**built, **({"role": role} if role else {}))


def _merge_speculative_config(section: dict[str, Any], value: str | dict) -> None:
    """vLLM's ``--speculative-config`` into the speculative section; a field also given by its own flag must
    agree.

    Raises:
        ValueError: bad JSON, an unsupported key, or a conflict with a ``--speculative-*`` flag (both named).
    """
    for key, v in parse_speculative_config(value).items():
        if key in section and section[key] != v:
            raise ValueError(f"--speculative-config sets {key} to {v!r} but --{key.replace('_', '-')} is "
                             f"{section[key]!r}")
        section[key] = v


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Build an `EngineConfig` from parsed flags (see `add_engine_args`)."""
    values = {f.dest: getattr(ns, f.dest, None) for f in ENGINE_FLAGS}
    return config_from_kwargs(role=getattr(ns, "role", None), **values)
