"""The memory planner's arithmetic: KV bytes per token, weights and pool per GPU, capacity.

SGLang's sizing rule: a GPU gives ``mem_fraction_static`` of its memory to
weights plus KV pool; the pool is what the weights leave of it. The context
length plays no part in sizing; it only caps what one request may ask for.

Local (sliding-window or chunked) layers: in every role the engine's hybrid
KV manager (`pd_cluster.engine.kv.groups`, ``ENGINE_FREES_WINDOW_PAGES``) keeps
a local layer's pages only for its window or chunk plus the prefill chunk being
computed, so a request's KV per token counts the global layers, and the local
layers add a bounded amount per request. The arithmetic is the engine's: layers
form groups of ``min(global, local)`` layers (a page holds one group's layers,
vLLM's page-size unification), and a local group holds at most
``ceil((span - 1 + chunked_prefill_size) / page_size) + 1`` pages (a decode
worker computes one token a step, so this bounds it too). Prefill and decode
workers (PD) move and hold only a local group's window
(`KVGroups.transfer_first_pages`). Pools with the hierarchical cache keep one
group, every layer's KV for every token: `make_plan` counts every layer there.

Linear-attention layers (Qwen3-Next's Gated DeltaNet) hold no KV per token: each request holds its float32
recurrent state in whole pages of the pool (the engine's state group), whatever its length. A request's bytes
are its KV layers' per token plus those pages (`Plan.kv_bytes_for`).

The KV dtype defaults to the engine's ``--kv-cache-dtype auto``: the model's
dtype (bf16 for an FP8 or int4 checkpoint, whose activations are bf16).

Weights per GPU: a quantised checkpoint's as the engine holds them (`pd_cluster.engine.planner.weights`:
quantised layers at their scheme's bits, the replicated embeddings, LM head and norms whole on every rank);
an unquantised one's parameters at ``--dtype`` divided by the TP size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pd_cluster.engine.planner.spec import ModelSpec

KV_BYTES = {"fp8_e4m3": 1, "bf16": 2, "fp16": 2, "fp32": 4}
KV_CACHE_DTYPES = ("auto", *KV_BYTES)
# Whether the engine's KV pool frees the pages a sliding-window or chunked layer will not read again: it does, in
# every role (engine/kv/groups.py, engine/scheduler/group_pages.py; a PD transfer moves only the window's pages).
ENGINE_FREES_WINDOW_PAGES = True
WINDOW_ROLES = ("mixed", "prefill", "decode")
ROLES = ("mixed", "prefill", "decode")
WEIGHT_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_CHUNKED_PREFILL_SIZE = 8192  # the engine's --chunked-prefill-size default


def check_instance_nodes(tp_size: int, nnodes: int, gpus_per_node: int) -> int:
    """The ranks a node of an instance of `tp_size` ranks over `nnodes` nodes runs (the engine's rule,
    `pd_cluster.engine.parallel.nodes.check_node_gpus`: every node runs ``tp_size / nnodes`` ranks).

    Raises:
        ValueError: `nnodes` does not divide `tp_size`, or a node would run more ranks than its GPUs; the message
            names the flag.
    """
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"--nnodes {nnodes} must divide --tp-size {tp_size}")
    per_node = tp_size // nnodes
    if per_node > gpus_per_node:
        raise ValueError(f"--tp-size {tp_size} over --nnodes {nnodes} is {per_node} ranks a node, more than its "
                         f"{gpus_per_node} GPUs: raise --nnodes")
    return per_node


@dataclass(frozen=True)
class PlanInput:
    """The deployment being planned (sizes in bytes)."""

    tp_size: int = 1
    gpus_per_node: int = 8
    gpu_memory: int = 143771 * 2**20  # H200 "141 GB": what nvidia-smi reports
    mem_fraction_static: float = 0.88
    kv_cache_dtype: str = "auto"  # the engine's default: the model's dtype
    weight_dtype: str = "bf16"
    page_size: int = 64
    context_length: int = 131072
    host_memory_per_node: int = 2 * 2**40  # a typical 8xH200 node has 2 TiB of DRAM
    enable_hierarchical_cache: bool = False  # a host tier per GPU (SGLang's HiCache L2)
    hicache_ratio: float = 2.0               # host tier tokens over device pool tokens
    hicache_size: int | None = None          # host tier bytes per GPU; overrides the ratio
    role: str = "mixed"                      # the worker's role: only the mixed role frees window pages
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    nnodes: int = 1                          # nodes one instance spans (``--nnodes``): tp_size / nnodes ranks a node

    @property
    def ranks_per_node(self) -> int:
        """The instance's ranks on each of its nodes: ``tp_size / nnodes``."""
        return self.tp_size // self.nnodes

    @property
    def kv_dtype(self) -> str:
        """The KV dtype the engine uses: `kv_cache_dtype`, ``auto`` being the model's dtype (bf16 for quantised
        weights: the activations' dtype)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return self.weight_dtype if self.weight_dtype in KV_BYTES else "bf16"

    def __post_init__(self) -> None:
        if not self.hicache_ratio > 0 or (self.hicache_size is not None and self.hicache_size <= 0):
            raise ValueError("hicache_ratio and hicache_size must be > 0")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        per_node = check_instance_nodes(self.tp_size, self.nnodes, self.gpus_per_node)
        if self.gpus_per_node % per_node:
            raise ValueError(f"--tp-size {self.tp_size} is {per_node} ranks a node, which does not divide a node's "
                             f"{self.gpus_per_node} GPUs (--gpus-per-node)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ValueError(f"weight dtype must be one of {sorted(WEIGHT_BYTES)}")


@dataclass(frozen=True)
class Plan:
    """The planner's answer; every size in bytes, capacities in tokens."""

    spec: ModelSpec
    inp: PlanInput
    kv_heads_per_gpu: int            # MLA: 1 (the latent, on every GPU)
    kv_bytes_per_token: int          # whole model, all layers, K and V (MLA: the latent)
    kv_bytes_per_token_per_gpu: int  # this GPU's heads; every layer (window_kv: the full groups' layer slots)
    local_kv_bytes_per_gpu: int      # window_kv: one request's local groups at their most pages; else 0
    weights_per_gpu: int
    pool_per_gpu: int
    tokens_per_instance: int
    instances_per_node: int          # instances a node (each of an instance's ``nnodes`` nodes) runs ranks of
    window_kv: bool = False          # local layers hold only their window or chunk (plus the prefill chunk)
    local_tokens: int = 0            # window_kv: tokens a local group holds at most per request (whole pages)
    local_bytes_per_token_per_gpu: int = 0  # window_kv: the local groups' layer slots, per token held
    page_layers: int = 0             # window_kv: layers of one page (the engine's group size)
    state_bytes_per_gpu: int = 0     # linear-attention layers: one request's state, in whole pages of the pool

    @property
    def tokens_per_node(self) -> int:
        """Pool tokens per node: an instance over ``nnodes`` nodes counts a share of its tokens on each."""
        return self.tokens_per_instance * self.instances_per_node // self.inp.nnodes

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

    @property
    def static_budget_per_gpu(self) -> int:
        """Bytes of one GPU for weights plus KV pool: ``gpu_memory * mem_fraction_static`` (SGLang's rule)."""
        return int(self.inp.gpu_memory * self.inp.mem_fraction_static)

    @property
    def weights_fit(self) -> bool:
        """Whether the weights leave any KV pool in the static budget; when they do not, the engine cannot start
        (its KV sizing refuses a budget that holds no page, `pd_cluster.engine.kv.sizing.plan_pool`)."""
        return self.pool_per_gpu > 0

    def requests_at_once(self, num_tokens: int) -> int:
        """How many requests of `num_tokens` tokens (page-rounded) fit in one instance's KV pool together."""
        padded = -(-num_tokens // self.inp.page_size) * self.inp.page_size
        return self.pool_per_gpu // max(self.kv_bytes_for(padded), 1) if self.pool_per_gpu > 0 else 0

    def kv_bytes_for(self, num_tokens: int) -> int:
        """KV bytes on one GPU for one request of `num_tokens` tokens."""
        if not self.window_kv:
            return num_tokens * self.kv_bytes_per_token_per_gpu + self.state_bytes_per_gpu
        padded = -(-num_tokens // self.inp.page_size) * self.inp.page_size
        return (num_tokens * self.kv_bytes_per_token_per_gpu
                + min(padded, self.local_tokens) * self.local_bytes_per_token_per_gpu)


def engine_frees_window_pages(spec: ModelSpec, inp: PlanInput) -> bool:
    """Whether the engine, deployed as `inp`, keeps only the window of `spec`'s local layers (module
    docstring): without the hierarchical cache, a model with local layers and no MLA (any role)."""
    return (ENGINE_FREES_WINDOW_PAGES and inp.role in WINDOW_ROLES and not inp.enable_hierarchical_cache
            and spec.local_layers > 0 and not spec.is_mla)


def make_plan(spec: ModelSpec, inp: PlanInput, window_kv: bool | None = None) -> Plan:
    """Compute a `Plan` for `spec` deployed as `inp`; with `window_kv` (default: what the engine does,
    `engine_frees_window_pages`), local layers hold only their window or chunk (module docstring)."""
    kvb = KV_BYTES[inp.kv_dtype]
    # KV heads split across TP ranks; with more ranks than KV heads each rank keeps one (replicated).
    heads_per_gpu = max(spec.num_kv_heads // inp.tp_size, 1)
    per_layer_token = spec.head_dim * 2 * kvb
    kv_heads = spec.num_kv_heads
    if spec.is_mla:  # one latent per token per layer, the same on every TP rank (it cannot be split by heads)
        heads_per_gpu, kv_heads, per_layer_token = 1, 1, spec.mla_latent_dim * kvb
    kv_layers = spec.num_layers - spec.state_layers  # linear-attention layers keep a state, no KV per token
    kv_total = kv_layers * kv_heads * per_layer_token
    if window_kv is None:
        window_kv = engine_frees_window_pages(spec, inp)
    window_kv = window_kv and spec.local_layers > 0
    weights = spec.weight_bytes(WEIGHT_BYTES[inp.weight_dtype], inp.tp_size)
    pool = int(inp.gpu_memory * inp.mem_fraction_static) - weights
    if not window_kv:
        kv_gpu = kv_layers * heads_per_gpu * per_layer_token
        page = inp.page_size * kv_gpu  # the engine's page: every KV layer of page_size tokens
        state = -(-spec.state_bytes_per_request // inp.tp_size // max(page, 1)) * page  # whole pages
        tokens = max(pool - state, 0) // max(kv_gpu, 1) // inp.page_size * inp.page_size
        return Plan(spec, inp, heads_per_gpu, kv_total, kv_gpu, 0, weights, pool, int(tokens),
                    inp.gpus_per_node // inp.ranks_per_node, state_bytes_per_gpu=state)
    # the engine's groups (plan_kv_groups): min(global, local) layers a page; each type fills whole groups
    group = min(spec.global_layers, spec.local_layers) if spec.global_layers else spec.local_layers
    full_slots = -(-spec.global_layers // group) * group
    local_slots = -(-spec.local_layers // group) * group
    ps = inp.page_size
    local_tokens = (-(-(int(spec.local_span or 0) - 1 + inp.chunked_prefill_size) // ps) + 1) * ps
    kv_gpu = full_slots * heads_per_gpu * per_layer_token
    local_per_token = local_slots * heads_per_gpu * per_layer_token
    local_gpu = local_tokens * local_per_token
    usable = max(pool - local_gpu, 0)
    tokens = usable // max(kv_gpu, 1) // ps * ps
    return Plan(spec, inp, heads_per_gpu, kv_total, kv_gpu, local_gpu, weights, pool, int(tokens),
                inp.gpus_per_node // inp.ranks_per_node, True, local_tokens, local_per_token, group)


def suggestions(plan: Plan) -> list[str]:
    """What would make the asked context fit, when it does not: only what the engine can do (it
    keeps a running request's KV on its GPUs: no live offload to host memory, no context parallelism)."""
    if plan.fits:
        return []
    s, inp = plan.spec, plan.inp
    if not plan.weights_fit:
        return _weight_suggestions(plan)
    out = _more_tp(plan)
    if inp.kv_dtype != "fp8_e4m3":
        fp8 = make_plan(s, replace(inp, kv_cache_dtype="fp8_e4m3"))
        verdict = "fits" if fp8.fits else "still does not fit"
        out.append(f"FP8 KV: --kv-cache-dtype fp8_e4m3 gives {fp8.tokens_per_instance:,} tokens ({verdict})")
    if s.local_layers and not plan.window_kv and not s.is_mla:
        mixed = make_plan(s, replace(inp, role="mixed", enable_hierarchical_cache=False))
        verdict = "fits" if mixed.fits else "still does not fit"
        why = ("without --enable-hierarchical-cache" if inp.enable_hierarchical_cache
               else "a mixed-role worker")
        out.append(f"window pages freed: {why} gives {mixed.tokens_per_instance:,} tokens ({verdict})")
    if not out:
        out.append("none the engine offers: a running request's KV must fit one instance's GPUs (no live offload "
                   "to host memory, no context parallelism)")
    return out


def _weight_suggestions(plan: Plan) -> list[str]:
    """When the weights alone exceed the static budget, KV choices cannot help: say what could."""
    s, inp = plan.spec, plan.inp
    out = _more_tp(plan)
    need = plan.weights_per_gpu / inp.gpu_memory
    if need < 1:
        out.append(f"a larger static share: the weights alone take {need:.2f} of each GPU, so "
                   f"--mem-fraction-static must exceed {need:.2f} before any KV page fits")
    if not out:
        quant = quant_note(s)
        quant = f" ({quant})" if quant else ""
        out.append(f"none the engine offers: the {inp.weight_dtype} weights need {plan.weights_per_gpu / 2**30:,.2f} "
                   f"GiB per GPU at TP {inp.tp_size}{quant}")
    return out


def quant_note(spec: ModelSpec) -> str:
    """How a quantised checkpoint's weights are held, in words ('' for unquantised weights)."""
    q = spec.quantized_weights(2, 1)
    if q is None:
        return ""
    kept = f"{q.quantized_params / 1e9:.1f}B of {q.params / 1e9:.1f}B parameters kept quantised"
    return f"{spec.quant.describe()}; {kept}"


def stored_weights(spec: ModelSpec, dtype: str) -> str:
    """The weights' formats as stored and held, in words: `dtype` for unquantised weights, else the quantised
    formats with the share left at `dtype` (DeepSeek-V3: ``FP8 128x128 blocks (bf16 for the other 0.4% of
    parameters)``)."""
    q = spec.quantized_weights(2, 1)
    if q is None or not q.quantized_params:
        return dtype
    formats = ", ".join(dict.fromkeys(_format_name(w) for w in spec.quant.weight_schemes))
    return f"{formats} ({dtype} for the other {100 * (1 - q.quantized_params / q.params):.1f}% of parameters)"


def _format_name(w) -> str:
    if w.kind == "fp8":
        return f"FP8 {w.block[0]}x{w.block[1]} blocks" if w.block else f"FP8 per {w.granularity}"
    if w.kind == "int4":
        return f"int4 groups of {w.group_size}" if w.group_size else "int4 per channel"
    return "MXFP4"


def _more_tp(plan: Plan) -> list[str]:
    """The more-TP tips: TP over the whole node, with its verdict; then the first of TP over 2 or 4 whole nodes
    (``--nnodes``, SGLang's multi-node tensor parallelism) that fits, if one does. None beyond what the
    deployment already spans."""
    inp, spec = plan.inp, plan.spec
    out = []
    for nodes in (1, 2, 4):
        tp = nodes * inp.gpus_per_node
        if tp <= inp.tp_size:
            continue
        more = make_plan(spec, replace(inp, tp_size=tp, nnodes=nodes))
        if nodes > 1 and not more.fits:
            continue
        verdict = ("fits" if more.fits else "still does not fit") if more.weights_fit else \
            "the weights still do not fit"
        flags = f"--tp-size {tp}" + (f" --nnodes {nodes}" if nodes > 1 else "")
        out.append(f"more TP: {flags} gives {more.tokens_per_instance:,} tokens ({verdict})")
        if more.fits:
            break
    return out
