"""The memory planner's arithmetic: KV bytes per token, weights and pool per GPU, capacity.

SGLang's sizing rule: a GPU gives ``mem_fraction_static`` of its memory to
weights plus KV pool; the pool is what the weights leave of it. The context
length plays no part in sizing; it only caps what one request may ask for.

Local (sliding-window or chunked) layers: the engine's pool holds every layer's
K and V for every token of a request; a window or a chunk is an attention mask,
not a page rule (`ENGINE_FREES_WINDOW_PAGES`). So a request's KV per token counts
every layer. `make_plan(..., window_kv=True)` gives the arithmetic of a pool whose
local layers hold only their last window or chunk (vLLM's hybrid KV cache manager,
SGLang's SWA pool); `pd-plan` prints it beside the engine's as what that design
would give.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pd_cluster.engine.planner.spec import ModelSpec

KV_BYTES = {"fp8_e4m3": 1, "bf16": 2, "fp16": 2, "fp32": 4}
# Whether the engine's KV pool frees the pages a sliding-window or chunked layer will not read again. It does not:
# every layer keeps every page of a request (engine/layer_attention.py describes the layers that could).
ENGINE_FREES_WINDOW_PAGES = False
WEIGHT_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class PlanInput:
    """The deployment being planned (sizes in bytes)."""

    tp_size: int = 1
    gpus_per_node: int = 8
    gpu_memory: int = 143771 * 2**20  # H200 "141 GB": what nvidia-smi reports
    mem_fraction_static: float = 0.88
    kv_cache_dtype: str = "fp8_e4m3"
    weight_dtype: str = "bf16"
    page_size: int = 64
    context_length: int = 131072
    host_memory_per_node: int = 2 * 2**40  # a typical 8xH200 node has 2 TiB of DRAM
    enable_hierarchical_cache: bool = False  # a host tier per GPU (SGLang's HiCache L2)
    hicache_ratio: float = 2.0               # host tier tokens over device pool tokens
    hicache_size: int | None = None          # host tier bytes per GPU; overrides the ratio

    def __post_init__(self) -> None:
        if not self.hicache_ratio > 0 or (self.hicache_size is not None and self.hicache_size <= 0):
            raise ValueError("hicache_ratio and hicache_size must be > 0")
        if self.tp_size < 1 or self.gpus_per_node % self.tp_size:
            raise ValueError(f"tp_size {self.tp_size} must divide gpus_per_node {self.gpus_per_node}")
        if self.kv_cache_dtype not in KV_BYTES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_BYTES)}")
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ValueError(f"weight dtype must be one of {sorted(WEIGHT_BYTES)}")


@dataclass(frozen=True)
class Plan:
    """The planner's answer; every size in bytes, capacities in tokens."""

    spec: ModelSpec
    inp: PlanInput
    kv_heads_per_gpu: int            # MLA: 1 (the latent, on every GPU)
    kv_bytes_per_token: int          # whole model, all layers, K and V (MLA: the latent)
    kv_bytes_per_token_per_gpu: int  # this GPU's heads; every layer (window_kv: global layers only)
    local_kv_bytes_per_gpu: int      # window_kv: local layers at a full window or chunk; else 0
    weights_per_gpu: int
    pool_per_gpu: int
    tokens_per_instance: int
    instances_per_node: int
    window_kv: bool = ENGINE_FREES_WINDOW_PAGES  # local layers hold only their window or chunk

    @property
    def tokens_per_node(self) -> int:
        return self.tokens_per_instance * self.instances_per_node

    @property
    def host_tokens_per_instance(self) -> int:
        """Tokens the host tier holds per instance (0 without one): ``--hicache-size`` bytes per GPU over the
        KV bytes per token per GPU, else ``--hicache-ratio`` x the pool's tokens; whole pages (SGLang's rule)."""
        inp = self.inp
        if not inp.enable_hierarchical_cache:
            return 0
        if inp.hicache_size is not None:
            tokens = inp.hicache_size // max(self.kv_bytes_per_token_per_gpu, 1)
        else:
            tokens = int(self.tokens_per_instance * inp.hicache_ratio)
        return tokens // inp.page_size * inp.page_size

    @property
    def host_bytes_per_gpu(self) -> int:
        """Host DRAM one GPU's host tier takes (every TP rank keeps its own heads' pages)."""
        return self.host_tokens_per_instance * self.kv_bytes_per_token_per_gpu

    @property
    def fits(self) -> bool:
        return self.tokens_per_instance >= self.inp.context_length

    def requests_at_once(self, num_tokens: int) -> int:
        """How many requests of `num_tokens` tokens (page-rounded) fit in one instance's KV pool together."""
        padded = -(-num_tokens // self.inp.page_size) * self.inp.page_size
        return self.pool_per_gpu // max(self.kv_bytes_for(padded), 1) if self.pool_per_gpu > 0 else 0

    def kv_bytes_for(self, num_tokens: int) -> int:
        """KV bytes on one GPU for one request of `num_tokens` tokens."""
        s = self.spec
        if not self.window_kv:
            return num_tokens * self.kv_bytes_per_token_per_gpu
        local = s.local_layers * self.kv_heads_per_gpu * s.head_dim * 2 * KV_BYTES[self.inp.kv_cache_dtype]
        return num_tokens * self.kv_bytes_per_token_per_gpu + min(num_tokens, s.local_span or 0) * local


def make_plan(spec: ModelSpec, inp: PlanInput, window_kv: bool = ENGINE_FREES_WINDOW_PAGES) -> Plan:
    """Compute a `Plan` for `spec` deployed as `inp`; with `window_kv`, local layers hold only their window or
    chunk (module docstring)."""
    kvb = KV_BYTES[inp.kv_cache_dtype]
    # KV heads split across TP ranks; with more ranks than KV heads each rank keeps one (replicated).
    heads_per_gpu = max(spec.num_kv_heads // inp.tp_size, 1)
    per_layer_token = spec.head_dim * 2 * kvb
    kv_heads = spec.num_kv_heads
    if spec.is_mla:  # one latent per token per layer, the same on every TP rank (it cannot be split by heads)
        heads_per_gpu, kv_heads, per_layer_token = 1, 1, spec.mla_latent_dim * kvb
    kv_total = spec.num_layers * kv_heads * per_layer_token
    window_kv = window_kv and spec.local_layers > 0
    kv_gpu = (spec.global_layers if window_kv else spec.num_layers) * heads_per_gpu * per_layer_token
    local_gpu = spec.local_layers * heads_per_gpu * per_layer_token * (spec.local_span or 0) if window_kv else 0
    weights = spec.num_params() * WEIGHT_BYTES[inp.weight_dtype] // inp.tp_size
    pool = int(inp.gpu_memory * inp.mem_fraction_static) - weights
    usable = max(pool - local_gpu, 0)
    tokens = usable // max(kv_gpu, 1) // inp.page_size * inp.page_size
    return Plan(spec, inp, heads_per_gpu, kv_total, kv_gpu, local_gpu, weights, pool, int(tokens),
                inp.gpus_per_node // inp.tp_size, window_kv)


def suggestions(plan: Plan) -> list[str]:
    """What would make the asked context fit on one node, when it does not."""
    if plan.fits:
        return []
    s, inp = plan.spec, plan.inp
    out = []
    if inp.tp_size < inp.gpus_per_node:
        full = make_plan(s, replace(inp, tp_size=inp.gpus_per_node), plan.window_kv)
        verdict = "fits" if full.fits else "still does not fit"
        out.append(f"more TP: --tp-size {inp.gpus_per_node} gives {full.tokens_per_instance:,} tokens ({verdict})")
    if inp.kv_cache_dtype != "fp8_e4m3":
        fp8 = make_plan(s, replace(inp, kv_cache_dtype="fp8_e4m3"), plan.window_kv)
        verdict = "fits" if fp8.fits else "still does not fit"
        out.append(f"FP8 KV: --kv-cache-dtype fp8_e4m3 gives {fp8.tokens_per_instance:,} tokens ({verdict})")
    need = plan.kv_bytes_for(inp.context_length) * inp.tp_size
    have = plan.pool_per_gpu * inp.tp_size
    host = need - have
    if host > 0:
        verdict = "within" if host <= inp.host_memory_per_node else "beyond"
        out.append(f"host tier: keep {host / 2**30:,.1f} GiB of this request's KV in host DRAM "
                   f"({verdict} the node's {inp.host_memory_per_node / 2**40:.0f} TiB)")
    return out
