"""Mixture-of-experts shapes and routing rules, read from Hugging Face ``config.json`` dicts.

Torch-free (the memory planner reads it). `RoutingConfig` is one small frozen
record that states, step by step, how a token picks its experts and their
weights; every family's router is a setting of it, read from its config by its family
(`Family.moe`, `pd_cluster.engine.model.families`):

======================  =========  ============  ======  ===========  =====================
family                  scoring    before top-k  groups  renormalise  other
======================  =========  ============  ======  ===========  =====================
Mixtral                 softmax    yes           --      yes          weights kept float32
Qwen3-MoE               softmax    yes           --      norm_topk_p  weights in act. dtype
DeepSeek-V2             softmax    yes           max     norm_topk_p  x routed_scaling_factor
DeepSeek-V3 / Kimi K2   sigmoid    yes           top2    norm_topk_p  + e_score_correction_bias
gpt-oss                 softmax    no (over k)   --      --           router bias
Llama 4                 sigmoid    no (top-1)    --      --           weight on the input
Qwen2-MoE               softmax    yes           --      norm_topk_p  gated shared expert
GLM-4-MoE               sigmoid    yes           top2    norm_topk_p  as DeepSeek-V3
Phi-3.5-MoE             sparsemixer (top-2)      --      --           weights in act. dtype
======================  =========  ============  ======  ===========  =====================

Sources: transformers' ``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``,
``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``, ``Llama4Router`` (5.24),
``Qwen2MoeTopKRouter``, ``Glm4MoeTopkRouter``, ``PhimoeTopKRouter`` and its ``sparsemixer`` (5.25; Liu et al.,
"GRIN: GRadient-INformed MoE", 2024), DeepSeek-V3 technical
report sec. 2.1.2 (auxiliary-loss-free balancing: the bias only chooses, it
never weights), vLLM's ``FusedMoE`` routing arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pd_cluster.engine.quant.expert_format import ExpertQuant

Scoring = Literal["softmax", "sigmoid", "sparsemixer"]
GroupScore = Literal["max", "top2_sum"]

EXPERT_ACTIVATIONS = ("silu", "swiglu_clamped")
"""Expert activations the engine computes: ``silu`` is SwiGLU, ``silu(gate) * up``; ``swiglu_clamped`` is
gpt-oss's: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``
(``GptOssExperts._apply_gate``; `MoEConfig.swiglu_alpha`, `MoEConfig.swiglu_limit`)."""


@dataclass(frozen=True)
class RoutingConfig:
    """How one token chooses `top_k` of `num_experts` experts and their weights, in this order:

    1. ``logits = x @ W_router.T`` (``+ b`` with `router_bias`), in float32 when `router_fp32`
       (DeepSeek keeps its router in float32), else in the activation dtype;
    2. with `score_before_topk`: ``scores = scoring(logits)`` over all experts, and the choice is made on
       ``scores (+ e_score_correction_bias)``; without it the choice is made on the raw logits;
    3. with ``n_group > 1``: the experts form `n_group` equal groups, each scored by its best choice value
       (``max``, DeepSeek-V2) or the sum of its best two (``top2_sum``, DeepSeek-V3); only the best
       `topk_group` groups stay eligible;
    4. ``ids = top_k(choice)``;
    5. weights: ``scores[ids]`` (with `score_before_topk`; the correction bias is not in them), else
       ``scoring(logits[ids])`` (softmax over the k chosen: gpt-oss; sigmoid of each: Llama 4);
    6. with `renormalize`: ``weights / sum(weights)`` (sigmoid scores add 1e-20 to the sum, as DeepSeek-V3);
    7. ``weights * routed_scaling_factor``; rounded to the activation dtype when
       `weights_in_activation_dtype` (Qwen-MoE), else kept in float32 (Mixtral, DeepSeek).

    `apply_weights_on_input` multiplies the expert's input by the weight instead of its output
    (Llama 4, top-1 only).

    ``sparsemixer`` (Phi-3.5-MoE, top-2 only) replaces steps 2 to 6, at inference: the first expert is the
    argmax of the logits, its weight the softmax of the logits masked to those within
    ``2 * jitter_eps`` (relative, ``(max - l) / max(|l|, max)``) of the max; the second is the argmax of the
    others, weighted likewise against its own max over the others.

    Raises:
        ValueError: inconsistent sizes (top_k > experts, groups that do not divide the experts, ...).
    """

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    score_before_topk: bool = True
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: GroupScore = "max"
    e_score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    router_fp32: bool = False
    weights_in_activation_dtype: bool = False
    apply_weights_on_input: bool = False
    jitter_eps: float = 0.01

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, {self.num_experts}]")
        if self.scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"unsupported MoE scoring_func {self.scoring!r}; supported: softmax, sigmoid, "
                             f"sparsemixer")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"num_experts_per_tok ({self.top_k}): sparsemixer routing is defined for top-2")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide the number of experts ({self.num_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of topk_group "
                             f"({self.topk_group}) groups")
        if self.group_score == "top2_sum" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("group scores summing the best two need at least 2 experts per group")
        if self.apply_weights_on_input and self.top_k != 1:
            raise ValueError("weights on the expert input are defined for top-1 routing only (Llama 4)")

    @property
    def renorm_eps(self) -> float:
        """Added to the renormalisation's denominator: 1e-20 for sigmoid scores (DeepSeek-V3), 0 for softmax."""
        return 1e-20 if self.scoring == "sigmoid" else 0.0


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a model.

    Attributes:
        num_experts: routed experts per MoE layer.
        intermediate_size: each routed expert's intermediate (SwiGLU) width.
        routing: how tokens choose experts (`RoutingConfig`).
        moe_layers: indices of the layers whose MLP is the MoE block; the others are dense.
        shared_intermediate_size: width of the shared expert(s) that every token goes through, 0 for
            none (DeepSeek: ``n_shared_experts * moe_intermediate_size``).
        shared_expert_gate: the shared expert's output is scaled by ``sigmoid(x @ w)`` (Qwen2-MoE).
        activation: the experts' activation (`EXPERT_ACTIVATIONS`).
        expert_bias: experts' gate/up and down projections carry biases (gpt-oss), added before the
            activation and before the routing weight.
        swiglu_alpha, swiglu_limit: ``swiglu_clamped``'s sigmoid gain and clamp (gpt-oss: 1.702, 7.0).
        weight_quant: the routed experts as the checkpoint stores them and the engine holds them, quantised
            (`ExpertQuant`: FP8 blocks, MXFP4), or None for the model dtype.

    Raises:
        ValueError: an activation the engine does not implement, named.
    """

    num_experts: int
    intermediate_size: int
    routing: RoutingConfig
    moe_layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    weight_quant: ExpertQuant | None = None

    def __post_init__(self) -> None:
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"MoE expert activation {self.activation!r} is not implemented "
                             f"(the engine implements {', '.join(EXPERT_ACTIVATIONS)})")
        if self.routing.num_experts != self.num_experts:
            raise ValueError(f"routing over {self.routing.num_experts} experts, layer has {self.num_experts}")

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def layer_params(self, hidden_size: int) -> int:
        """Parameters of one MoE block: router, routed experts, shared experts (and their gate)."""
        h = hidden_size
        router = self.num_experts * h + (self.num_experts if self.routing.router_bias else 0) \
            + (self.num_experts if self.routing.e_score_correction_bias else 0)
        shared = 3 * h * self.shared_intermediate_size + (h if self.shared_expert_gate else 0)
        return router + self.num_experts * self._expert_params(h) + shared

    def _expert_params(self, h: int) -> int:
        return 3 * h * self.intermediate_size + ((2 * self.intermediate_size + h) if self.expert_bias else 0)

    def active_layer_params(self, hidden_size: int) -> int:
        """Parameters one token multiplies through in one MoE block: router, top_k experts, shared ones."""
        h = hidden_size
        shared = 3 * h * self.shared_intermediate_size + (h if self.shared_expert_gate else 0)
        router = self.num_experts * h + (self.num_experts if self.routing.router_bias else 0)
        return router + self.top_k * self._expert_params(h) + shared


def check_moe_parallel(cfg: MoEConfig, tp_size: int, expert_parallel: bool, num_redundant: int = 0) -> None:
    """Refuse a TP size that cannot split this MoE block: the experts' width under TP (for quantised experts, in
    whole blocks: `ExpertQuant.check_split`), their count under expert parallelism, and the shared experts'
    width (always TP-split), and with ``--ep-num-redundant-experts`` (`num_redundant`) the physical experts' count.

    Raises:
        ValueError: naming the sizes.
    """
    if expert_parallel and cfg.num_experts % tp_size:
        raise ValueError(f"--tp-size {tp_size} with --enable-expert-parallel must divide the number of experts "
                         f"({cfg.num_experts})")
    if expert_parallel and (cfg.num_experts + num_redundant) % tp_size:
        raise ValueError(f"--ep-num-redundant-experts {num_redundant}: the {cfg.num_experts} experts and the "
                         f"redundant ones must be a multiple of the expert-parallel size {tp_size}")
    mxfp4 = cfg.weight_quant is not None and cfg.weight_quant.format == "mxfp4"  # split in whole blocks, padded
    if not expert_parallel and cfg.intermediate_size % tp_size and not mxfp4:
        raise ValueError(f"--tp-size {tp_size} must divide the experts' intermediate size ({cfg.intermediate_size})")
    if cfg.weight_quant is not None and not (expert_parallel and tp_size > 1):
        cfg.weight_quant.check_split(cfg.intermediate_size, tp_size)
    if cfg.shared_intermediate_size % tp_size:
        raise ValueError(f"--tp-size {tp_size} must divide the shared experts' intermediate size "
                         f"({cfg.shared_intermediate_size})")
