"""Planning a wide expert-parallel instance: DP attention with the experts spread over every rank, on one or
several nodes (the decode shape of SGLang's and vLLM's large-scale DeepSeek-V3 deployments).

SGLang's meaning of the flags (``--tp-size T --dp-size D --enable-dp-attention [--enable-expert-parallel]
--nnodes N``): one instance of ``T`` ranks on ``N`` nodes. Attention is data-parallel: ``D`` groups of ``T / D``
ranks, each group with its own requests and KV pool, its attention projections split over its ``T / D`` ranks
(all of them whole on every rank at ``D = T``). The MLPs and routed experts are split over all ``T`` ranks; with
expert parallelism each rank holds ``E / T`` whole experts (the same bytes as a ``1 / T`` slice of each).
Embeddings, LM head, norms and the router are replicated, as the engine holds them (`weights`).

KV: a DP group's pool holds only its own requests; MLA's latent is the same on every rank of a group, GQA heads
are split over the group's ranks (at most one head each). So the tokens an instance holds are ``D`` times what
one group holds.

Communication per decode step, per rank, with ``B`` tokens on each DP group (`WideEPInput.batch_per_rank`):
- **all-to-all (wide EP)**: each token's hidden state goes to the ranks of its ``k`` routed experts (dispatch,
  FP8 with one float32 scale per 128 values, as DeepEP's low-latency kernels send it) and comes back weighted
  (combine, bf16), one copy per expert, no deduplication: an upper bound. With uniform routing ``(T-1)/T`` of the
  copies leave the rank: ``B x k x (T-1)/T x (dispatch + combine) bytes`` per MoE layer.
- **all-reduce (the TP alternative at the same batch)**: a TP-``T`` instance running the same ``B x D`` tokens
  all-reduces the attention and MLP outputs (bf16) twice a layer; a ring all-reduce sends ``2 (T-1) / T`` of the
  tensor from each rank.

Sources: SGLang's large-scale EP blog (lmsys.org, 2025-05-05) and DeepEP's documentation for the dispatch and
combine formats; Megatron-LM (Shoeybi et al. 2019) for the TP all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.engine.planner.plan import KV_BYTES, WEIGHT_BYTES, PlanInput, check_instance_nodes
from pd_cluster.engine.planner.spec import ModelSpec
from pd_cluster.engine.planner.weights import WeightBytes, weight_bytes

DISPATCH_GROUP = 128  # values per FP8 scale in DeepEP's dispatch
# What this engine runs today: DP attention in the offline engine (`pd_cluster.engine.executor.dp`) and in decode
# workers (`pd_cluster.decode.dp_instance`), --tp-size equal to --dp-size, on one node; a TP instance may span nodes,
# DP attention not.
ENGINE_MAX_NNODES = 1
ENGINE_DP_ATTENTION_ROLES = ("decode",)


@dataclass(frozen=True)
class WideEPInput:
    """One wide-EP instance (module docstring).

    Attributes:
        base: memory, dtypes, page size and context as for any plan (`PlanInput`; its ``tp_size`` is ignored).
        tp_size: ranks of the instance (``--tp-size``), over every node.
        dp_size: DP attention groups (``--dp-size``); ``tp_size`` must be a multiple of it.
        enable_expert_parallel: whole experts per rank (``--enable-expert-parallel``); else a slice of each.
        nnodes: nodes the instance spans (``--nnodes``); ``tp_size / nnodes`` ranks a node.
        batch_per_rank: decode tokens each DP group runs per step, for the communication estimate.
        num_redundant_experts: EPLB's extra physical experts over the ranks (``--ep-num-redundant-experts``).
    """

    base: PlanInput
    tp_size: int
    dp_size: int
    enable_expert_parallel: bool = True
    nnodes: int = 1
    batch_per_rank: int = 128
    num_redundant_experts: int = 0

    def check(self, spec: ModelSpec) -> None:
        """Raises ValueError naming the flag when the instance cannot be laid out."""
        if self.dp_size < 2:
            raise ValueError(f"--enable-dp-attention needs --dp-size > 1, got {self.dp_size}")
        if self.tp_size % self.dp_size:
            raise ValueError(f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size}")
        check_instance_nodes(self.tp_size, self.nnodes, self.base.gpus_per_node)
        if not spec.num_experts:
            raise ValueError(f"--enable-dp-attention plans a MoE model (its experts spread over the ranks); "
                             f"{spec.name} is dense")
        if self.enable_expert_parallel and spec.num_experts % self.tp_size:
            raise ValueError(f"--enable-expert-parallel: {spec.num_experts} experts do not divide over "
                             f"--tp-size {self.tp_size} ranks")
        r = self.num_redundant_experts
        if r < 0 or (r and not self.enable_expert_parallel):
            raise ValueError(f"--ep-num-redundant-experts {r}: needs --enable-expert-parallel and a count >= 0")
        if r and (spec.num_experts + r) % self.tp_size:
            raise ValueError(f"--ep-num-redundant-experts {r}: the {spec.num_experts} experts and the redundant ones "
                             f"must be a multiple of --tp-size {self.tp_size}")
        if spec.arch is None:
            raise ValueError(f"{spec.name}: the engine cannot build this model's shape ({spec.refusal})")
        if self.batch_per_rank < 1:
            raise ValueError(f"--decode-batch-per-rank must be >= 1, got {self.batch_per_rank}")

    @property
    def attention_tp_size(self) -> int:
        return self.tp_size // self.dp_size


@dataclass(frozen=True)
class WideEPPlan:
    """The plan of one wide-EP instance; bytes, tokens and bytes per decode step per rank."""

    inp: WideEPInput
    weights: WeightBytes
    pool_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    tokens_per_dp_rank: int
    all_to_all_bytes_per_step: int   # sent by one rank per decode step (dispatch + combine), upper bound
    all_reduce_bytes_per_step: int   # sent by one rank of a TP instance running the same tokens

    @property
    def tokens_per_instance(self) -> int:
        return self.tokens_per_dp_rank * self.inp.dp_size

    @property
    def weights_fit(self) -> bool:
        return self.pool_per_gpu > 0

    @property
    def engine_refusal(self) -> str | None:
        """Why this engine cannot run the instance yet, None when it can."""
        why = []
        if self.inp.base.role not in ENGINE_DP_ATTENTION_ROLES:
            why.append(f"a {self.inp.base.role} worker refuses --enable-dp-attention (decode workers and the offline "
                       "engine run it)")
        if self.inp.tp_size != self.inp.dp_size:
            why.append(f"attention TP inside a DP rank (--tp-size {self.inp.tp_size} over --dp-size "
                       f"{self.inp.dp_size}) is not built")
        if self.inp.nnodes > ENGINE_MAX_NNODES:
            why.append(f"DP attention runs on one node (--nnodes {self.inp.nnodes} asked)")
        return "; ".join(why) or None


def plan_wide_ep(spec: ModelSpec, inp: WideEPInput) -> WideEPPlan:
    """The wide-EP plan of `spec` (module docstring). Raises ValueError naming a flag (`WideEPInput.check`)."""
    inp.check(spec)
    base = inp.base
    dtype_bytes = WEIGHT_BYTES[base.weight_dtype]
    weights = weight_bytes(spec.arch, spec.quant, dtype_bytes, inp.tp_size,
                           attention_tp_size=inp.attention_tp_size, redundant_experts=inp.num_redundant_experts)
    pool = int(base.gpu_memory * base.mem_fraction_static) - weights.total
    kvb = KV_BYTES[base.kv_dtype]
    kv_layers = spec.num_layers - spec.state_layers
    if spec.is_mla:
        per_token = kv_layers * spec.mla_latent_dim * kvb
    else:
        per_token = kv_layers * max(spec.num_kv_heads // inp.attention_tp_size, 1) * spec.head_dim * 2 * kvb
    tokens = max(pool, 0) // per_token // base.page_size * base.page_size
    h, t, b = spec.hidden_size, inp.tp_size, inp.batch_per_rank
    dispatch = h + h // DISPATCH_GROUP * 4  # FP8 values and their float32 scales
    combine = h * 2
    a2a = spec.moe_layers * b * spec.experts_per_token * (dispatch + combine) * (t - 1) // t
    all_reduce = 2 * spec.num_layers * (b * inp.dp_size) * h * 2 * 2 * (t - 1) // t
    return WideEPPlan(inp, weights, pool, per_token, int(tokens), int(a2a), int(all_reduce))


def render_wide_ep(spec: ModelSpec, plan: WideEPPlan) -> str:
    """`pd-plan`'s table for a wide-EP instance."""
    inp, base = plan.inp, plan.inp.base
    gib = 2**30
    r = inp.num_redundant_experts
    ep = (f"EP {inp.tp_size}: {(spec.num_experts + r) // inp.tp_size} whole experts a rank"
          + (f" ({r} redundant over the instance, EPLB)" if r else "") if inp.enable_expert_parallel
          else f"experts sliced over {inp.tp_size} ranks")
    refusal = plan.engine_refusal
    rows = [
        ("model", f"{spec.name}: {spec.num_layers} layers, {spec.num_experts} experts (top {spec.experts_per_token})"
                  f" in {spec.moe_layers} MoE layers"),
        ("deployment", f"--tp-size {inp.tp_size} --dp-size {inp.dp_size} --enable-dp-attention, {ep}, "
                       f"{inp.nnodes} node(s) x {inp.tp_size // inp.nnodes} GPUs of {base.gpu_memory / gib:,.2f} GiB, "
                       f"mem_fraction_static {base.mem_fraction_static}, KV {base.kv_dtype}"),
        ("attention", f"{inp.dp_size} DP groups of {inp.attention_tp_size} rank(s), each its own requests and pool"),
        ("weights per GPU", f"{plan.weights.total / gib:,.2f} GiB ({plan.weights.quantized / gib:,.2f} quantised, "
                            f"{plan.weights.plain / gib:,.2f} split at {base.weight_dtype}, "
                            f"{plan.weights.replicated / gib:,.2f} replicated)"),
        ("KV pool per GPU", f"{plan.pool_per_gpu / gib:,.2f} GiB" if plan.weights_fit else
         f"none: the weights exceed the static budget by {-plan.pool_per_gpu / gib:,.2f} GiB"),
        ("KV bytes/token (per GPU)", f"{plan.kv_bytes_per_token_per_gpu:,} B"),
        ("KV tokens per DP rank", f"{plan.tokens_per_dp_rank:,}"),
        ("KV tokens per instance", f"{plan.tokens_per_instance:,} ({inp.dp_size} DP ranks)"),
        ("all-to-all per decode step", f"{plan.all_to_all_bytes_per_step / 2**20:,.1f} MiB sent per rank at "
                                       f"{inp.batch_per_rank} tokens a DP rank (dispatch FP8 + combine bf16, "
                                       f"top {spec.experts_per_token}, no deduplication: an upper bound)"),
        ("TP all-reduce, same batch", f"{plan.all_reduce_bytes_per_step / 2**20:,.1f} MiB sent per rank by a TP-"
                                      f"{inp.tp_size} instance running the same {inp.batch_per_rank * inp.dp_size} "
                                      f"tokens (bf16, two a layer, ring)"),
        ("engine support", f"NOT SERVABLE by this engine yet: {refusal}" if refusal else "yes"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
