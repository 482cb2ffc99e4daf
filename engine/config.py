"""Typed, frozen configuration of one engine instance.

One dataclass per component, validated in `__post_init__`, in the style of
nano-vllm's `Config` and mini-sglang's frozen configs. `EngineConfig` groups
them; `pd_cluster.engine.args` builds it from SGLang-named command-line flags.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.model.eplb_config import EPLBConfig
from pd_cluster.engine.parallel.nodes import check_dp, check_nodes
from pd_cluster.engine.spec.config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3")
ROLES = ("mixed", "prefill", "decode")
STORAGE_BACKENDS = ("file", "mooncake")
STORAGE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
Role = Literal["mixed", "prefill", "decode"]

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``2GiB``, ``512MiB``, ``1.5GB`` or ``1048576``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones
    (KB, MB, GB, TB) powers of 1000.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 2GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    """Format bytes in GiB/MiB/KiB with two decimals, e.g. ``1.50 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how to load it.

    Attributes:
        model: an HF checkpoint folder; None means the embedded stories260K.
        tokenizer: a tokenizer folder; None means the model folder.
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        load_format: ``auto`` (safetensors) or ``dummy`` (random weights of the
            config's shape, for benchmarks without weights; as vLLM's flag).
        served_model_name: the name in ``/v1/models``; default: the folder name.
        seed: seed of the dummy weights.
        generation_config: ``auto`` (the model folder's ``generation_config.json``: its EOS ids end generation
            and its sampling fields are the requests' defaults), ``vllm`` (the engine's defaults; the folder's EOS
            ids still apply) or a folder to read ``generation_config.json`` from (vLLM's flag;
            `pd_cluster.engine.model.generation_config`).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    served_model_name: str | None = None
    seed: int = 0
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if not self.generation_config:
            raise ValueError("generation_config must be auto, vllm or a folder, got an empty string")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")

    @property
    def path(self) -> str:
        """The checkpoint folder actually used."""
        return self.model or DEFAULT_MODEL

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    @property
    def name(self) -> str:
        """The served model name."""
        if self.served_model_name:
            return self.served_model_name
        return self.path.rstrip("/").split("/")[-1]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    Attributes:
        page_size: tokens per page, 1..256. Default 64: a 2k-token prompt is
            32 pages (short block tables, few transfer descriptors: vLLM RFC
            #50913 measured 58 ms saved by 64 over 16 on a 5k pull), and a page
            of one KV head is a full 64-row tile for the attention kernels. The
            cost is at most 63 tokens of slack per request.
        kv_cache_dtype: ``auto`` (the model dtype), ``bf16``, ``fp16``, ``fp32``
            or ``fp8_e4m3`` (per-layer k/v scales; SGLang/vLLM flag name).
        mem_fraction_static: on GPU, the fraction of device memory for weights
            plus KV pool (SGLang's flag).
        kv_cache_memory: bytes for the KV pool; required meaning on CPU,
            overrides `mem_fraction_static` on GPU when set.
        num_pages: exact number of usable pages (tests and planners); overrides
            both budgets when set.
        disable_radix_cache: turn the prefix cache off (SGLang's flag; vLLM's
            ``--no-enable-prefix-caching`` is an alias). The cache is on by
            default in every role; a decode worker keeps finished requests'
            pages in it and asks prefill workers only for the pages it lacks.
        enable_hierarchical_cache: keep pages the prefix cache evicts in a host-memory
            tier and load them back on a hit (SGLang's HiCache L2 flag; default off;
            prefill and mixed roles).
        hicache_ratio: host pool size over device pool size, in tokens (SGLang's
            ``--hicache-ratio``, default 2.0).
        hicache_size: bytes of the host pool; overrides `hicache_ratio` when set
            (SGLang's ``--hicache-size``, whose bare numbers are GB).
        hicache_storage_backend: the cluster-wide KV store behind the cache (SGLang's HiCache L3 flag):
            ``mooncake`` (Mooncake Store) or ``file`` (a directory); None: off. Every role reads it on a miss
            and writes what it computes (``docs/kv-store.md``).
        hicache_storage_backend_extra_config: a JSON object of the store's settings (SGLang's flag): Mooncake's
            ``master_server_address``, ``metadata_server``, ``protocol``, ``device_name``, ``local_hostname``,
            ``global_segment_size``, ``local_buffer_size``; the file store's ``storage_dir``; and
            ``prefetch_timeout`` (seconds). Unset keys come from SGLang's environment variables.
        hicache_storage_prefetch_policy: when a request stops waiting for its pages from the store (SGLang's):
            ``timeout`` (default: when read, or after ``prefetch_timeout``), ``best_effort`` (at once, with what
            is read by then) or ``wait_complete`` (when read).
        hicache_storage_required: refuse to start when the store cannot be reached (default: warn and serve
            without it until it answers).
        disable_hybrid_kv_cache_manager: keep every layer's KV for every token (one KV group), also on a model
            with sliding-window or chunked layers (vLLM's flag). By default such a model's layers form KV
            groups and window layers hold only their window's pages (`pd_cluster.engine.kv.groups`; mixed
            role only: the prefill and decode roles keep one group, the layout KV transfers move).
    """

    page_size: int = 64
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float = 0.88
    kv_cache_memory: int | None = None
    num_pages: int | None = None
    disable_radix_cache: bool = False
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int | None = None
    hicache_storage_backend: str | None = None
    hicache_storage_backend_extra_config: str | None = None
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_required: bool = False
    disable_hybrid_kv_cache_manager: bool = False

    @property
    def enable_prefix_caching(self) -> bool:
        return not self.disable_radix_cache

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= 256:
            raise ValueError(f"page_size must be in 1..256, got {self.page_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not self.hicache_ratio > 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        if self.hicache_size is not None and self.hicache_size <= 0:
            raise ValueError(f"hicache_size must be positive, got {self.hicache_size}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache and disable_radix_cache are mutually exclusive "
                             "(the host tier holds pages the prefix cache evicts)")
        if self.hicache_storage_backend is not None:
            if self.hicache_storage_backend not in STORAGE_BACKENDS:
                raise ValueError(f"hicache_storage_backend must be one of {STORAGE_BACKENDS}, got "
                                 f"{self.hicache_storage_backend!r}")
            if self.disable_radix_cache:
                raise ValueError("hicache_storage_backend and disable_radix_cache are mutually exclusive (the store "
                                 "serves the prefix cache's misses)")
        if self.hicache_storage_prefetch_policy not in STORAGE_PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy must be one of {STORAGE_PREFETCH_POLICIES}, got "
                             f"{self.hicache_storage_prefetch_policy!r}")
        if self.hicache_storage_backend_extra_config is not None:
            try:
                extra = json.loads(self.hicache_storage_backend_extra_config)
            except ValueError as e:
                raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ValueError("hicache_storage_backend_extra_config must be a JSON object")


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler (vLLM v1 model, SGLang flag names).

    Attributes:
        context_length: the longest prompt + output accepted; None: the model's
            ``max_position_embeddings``. It never sizes the pool.
        chunked_prefill_size: the most prompt tokens of one request per step.
        max_prefill_tokens: the token budget of one step (prefill plus decode).
        max_running_requests: the most requests in the running batch.
        max_queued_requests: waiting requests beyond which new ones are refused.
        schedule_conservativeness: scales the new-token-ratio reservation (SGLang).
        schedule_policy: ``fcfs``.
        decode_log_interval: log a ``Decode batch.`` line every this many decode steps.
        max_local_prefill_length: decode role: a remote request whose prompt, less what this
            worker's prefix cache holds, has at most this many tokens is prefilled here, without
            a prefill worker (Dynamo's conditional disaggregation and flag: remote iff
            ``prompt_len - prefix_hit_len > max_local_prefill_length``). Default 0: never, since
            every prompt has at least one uncached token; a local prefill runs inside the decode
            batch and delays every running request's next token, so it is opt-in.
    """

    context_length: int | None = None
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    max_queued_requests: int = 4096
    schedule_conservativeness: float = 1.0
    schedule_policy: str = "fcfs"
    decode_log_interval: int = 40
    max_local_prefill_length: int = 0

    def __post_init__(self) -> None:
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.schedule_conservativeness <= 0:
            raise ValueError(f"schedule_conservativeness must be > 0, got {self.schedule_conservativeness}")
        if self.schedule_policy != "fcfs":
            raise ValueError(f"schedule_policy must be fcfs, got {self.schedule_policy!r}")
        if self.decode_log_interval < 1:
            raise ValueError(f"decode_log_interval must be >= 1, got {self.decode_log_interval}")
        if self.max_local_prefill_length < 0:
            raise ValueError(f"max_local_prefill_length must be >= 0, got {self.max_local_prefill_length}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: this process is rank `tp_rank` of `tp_size`.

    `enable_expert_parallel`: MoE layers split their experts across the TP ranks (whole experts each)
    instead of each expert's width (`pd_cluster.engine.model.moe`).
    `dp_size`, `enable_dp_attention`: SGLang's data-parallel attention: the `tp_size` ranks form `dp_size`
    attention groups, each with its own requests and KV pool (`pd_cluster.engine.parallel.dp_attention`).
    `ep_num_redundant_experts`, `enable_eplb`, `eplb_rebalance_num_iterations`: expert load balancing (SGLang's
    flags; `pd_cluster.engine.model.eplb`).
    `prefill_context_parallel_size`: ranks that split one prompt's prefill chunk
    (`pd_cluster.engine.parallel.context_parallel`).
    """

    tp_size: int = 1
    tp_rank: int = 0
    enable_expert_parallel: bool = False
    dp_size: int = 1
    enable_dp_attention: bool = False
    prefill_context_parallel_size: int = 1
    nnodes: int = 1                    # nodes the instance spans (`pd_cluster.engine.parallel.nodes`)
    node_rank: int = 0                 # this node's place among them; node 0 runs rank 0
    dist_init_addr: str | None = None  # node 0's HOST:PORT where every node's ranks meet
    dist_timeout: int | None = None    # seconds the ranks (and nodes) have to meet; None: 120 on one node, 600 over several
    ep_num_redundant_experts: int = 0  # EPLB: extra physical experts over the EP group (`engine.model.eplb`)
    enable_eplb: bool = False          # EPLB: rebalance the experts from their recorded load
    eplb_rebalance_num_iterations: int | None = None  # EPLB: steps between two rebalances (None: 1000)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need tp_size >= 1 and 0 <= tp_rank < tp_size, got {self.tp_size}, {self.tp_rank}")
        if self.prefill_context_parallel_size < 1:
            raise ValueError(f"--prefill-context-parallel-size must be at least 1, got "
                             f"{self.prefill_context_parallel_size}")
        check_dp(self.tp_size, self.dp_size, self.enable_dp_attention)
        if self.prefill_context_parallel_size > 1 and self.enable_dp_attention:
            raise ValueError("--prefill-context-parallel-size with --enable-dp-attention is not built (each DP rank "
                             "prefills its own requests whole)")
        check_nodes(self.world_size, self.nnodes, self.node_rank, self.dist_init_addr, self.enable_dp_attention,
                    self.prefill_context_parallel_size)
        if self.dist_timeout is not None and self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be positive, got {self.dist_timeout}")
        self.eplb.check(self.enable_expert_parallel, self.prefill_context_parallel_size > 1)  # over several ranks: `LLMEngine` (a DP rank's config has TP 1)

    @property
    def eplb(self) -> EPLBConfig:
        """The EPLB settings (`pd_cluster.engine.model.eplb`)."""
        return EPLBConfig(self.ep_num_redundant_experts, self.enable_eplb, self.eplb_rebalance_num_iterations)

    @property
    def world_size(self) -> int:
        """The instance's rank processes: TP ranks times context-parallel ranks."""
        return self.tp_size * self.prefill_context_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs and which kernels it uses.

    Attributes:
        device: ``auto`` (cuda when available, else cpu), ``cpu`` or ``cuda[:N]``.
        attention_backend: ``auto`` (triton on cuda; on cpu the compiled kernel, else torch),
            ``torch``, ``cpu`` or ``triton``.
        disable_cuda_graph: replay no CUDA graphs (SGLang flag).
        cuda_graph_max_bs: the largest decode batch captured in a graph (SGLang flag).
        disable_overlap_schedule: schedule each step only after the previous one's tokens are on the host
            (SGLang flag). Overlap scheduling is on by default on CUDA (`pd_cluster.engine.overlap`).
        enable_overlap_schedule: overlap scheduling also off CUDA (it gains nothing there, where torch runs
            each op before returning; for tests of the CUDA path's bookkeeping).
        cpu_threads: intra-op threads of this process on CPU. Default 1: the CPU
            path serves small models, whose many tiny kernels run slower with
            more threads, and a local cluster runs several workers per host
            (OpenMP threads spin-waiting against each other cost 10-50x).
    """

    device: str = "auto"
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    disable_overlap_schedule: bool = False
    enable_overlap_schedule: bool = False
    cpu_threads: int = 1

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.disable_overlap_schedule and self.enable_overlap_schedule:
            raise ValueError("disable_overlap_schedule and enable_overlap_schedule are exclusive")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs. `role` picks the scheduler's role."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    role: Role = "mixed"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.cache.hicache_storage_backend and self.parallel.tp_size > 1:
            raise ValueError("hicache_storage_backend is not built for tp_size > 1 yet (each rank would read and "
                             "write its own share of every page)")
        if self.cache.enable_hierarchical_cache and self.parallel.tp_size > 1:
            raise ValueError("enable_hierarchical_cache is not built for tp_size > 1 yet (each rank would need "
                             "its own host pool and copies in lockstep)")
