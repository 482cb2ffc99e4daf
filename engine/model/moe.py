"""The mixture-of-experts block: router, routed experts, shared experts, under TP or expert parallelism.

`select_experts` applies a `RoutingConfig` (see `pd_cluster.engine.model.moe_config`)
to router logits. `torch_fused_experts` (`pd_cluster.engine.model.layer_ops`, beside the other
reference ops) is the reference (CPU) expert computation: the (token, choice) pairs are
sorted by expert and each expert runs one GEMM over its rows (a grouped GEMM in plain torch). The Triton path
(`pd_cluster.engine.attention.triton.fused_moe`) does the same in two kernel
launches; the layer reaches either through its layer ops
(`TorchLayerOps.fused_experts` / `TritonLayerOps.fused_experts`).

Parallelism (vLLM's ``FusedMoE``): under tensor parallelism every rank holds
every expert with 1/N of its intermediate width (gate/up rows, down columns;
Megatron-LM's split applied per expert); with expert parallelism rank r holds
experts ``[r E / N, (r + 1) E / N)`` whole and skips the others. Either way
the tokens are replicated on every rank (the attention all-reduce leaves
them so), each rank computes a partial sum, and one all-reduce after the
shared experts completes it. Under DP attention each rank holds other tokens: the
block gathers every DP rank's tokens first and returns each rank its own rows of
the sum (`pd_cluster.engine.parallel.dp_attention`, ``docs/moe.md``). With EPLB (redundant experts, rebalancing:
`pd_cluster.engine.model.eplb`) the ranks hold physical slots and the router's logical choices are mapped to them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pd_cluster.engine.model.layer_ops import TORCH_OPS, TorchLayerOps
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig, check_moe_parallel
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.experts import QuantizedExperts, quantized_storage
from pd_cluster.engine.quant.modules import make_linear


def _score(x: torch.Tensor, scoring: str) -> torch.Tensor:
    return x.softmax(dim=-1) if scoring == "softmax" else x.sigmoid()


def select_experts(logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens (the steps of `RoutingConfig`'s docstring).

    Args:
        logits: [T, E] router logits (any float dtype; scores are computed in float32).
        cfg: the routing rule.
        correction_bias: [E] float32 ``e_score_correction_bias`` when ``cfg.e_score_correction_bias``.

    Returns:
        (weights [T, top_k] float32, ids [T, top_k] int64). Ties go to the lower expert index
        (``torch.topk``), as in transformers.
    """
    logits = logits.float()
    if cfg.scoring == "sparsemixer":
        return sparsemixer(logits, cfg.jitter_eps)
    if cfg.score_before_topk:
        scores = _score(logits, cfg.scoring)
        choice = scores if correction_bias is None else scores + correction_bias
    else:
        scores, choice = None, logits
    if cfg.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        group_scores = (grouped.max(dim=-1).values if cfg.group_score == "max"
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_group, dim=-1)[1], 1.0)
        keep = keep.bool().unsqueeze(-1).expand(t, cfg.n_group, e // cfg.n_group).reshape(t, e)
        # DeepSeek-V2 zeroes the dropped softmax scores, V3 sets its biased choices to -inf
        choice = choice.masked_fill(~keep, float("-inf") if cfg.e_score_correction_bias else 0.0)
    top_values, ids = choice.topk(cfg.top_k, dim=-1)
    if scores is not None:
        weights = scores.gather(1, ids)
    else:
        weights = _score(top_values, cfg.scoring)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + cfg.renorm_eps)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def sparsemixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's top-2 routing at inference (`RoutingConfig`'s docstring; transformers' ``sparsemixer``
    with ``training`` false): (weights [T, 2], ids [T, 2]) from logits [T, E]."""
    weights, ids, rest = [], [], logits
    for _ in range(2):
        top, idx = rest.max(dim=-1, keepdim=True)
        far = ((top - logits) / logits.abs().clamp(min=top)) > 2 * jitter_eps
        weights.append(rest.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, idx))
        ids.append(idx)
        rest = rest.scatter(-1, idx, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class Router(nn.Module):
    """The gate: ``weight`` [E, H] (float32 when ``router_fp32``), optional ``bias`` and
    ``e_score_correction_bias`` [E] float32. Replicated on every rank."""

    def __init__(self, hidden_size: int, cfg: RoutingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dtype = torch.float32 if cfg.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=dtype)) if cfg.router_bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))
                                        if cfg.e_score_correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int64) for x [T, H]."""
        if self.cfg.router_fp32:
            logits = F.linear(x.float(), self.weight, self.bias)
        else:
            logits = F.linear(x, self.weight, self.bias)
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class SharedExperts(nn.Module):
    """Dense SwiGLU MLP that every token goes through (DeepSeek ``shared_experts``), its width split across TP
    ranks like a dense MLP; no all-reduce of its own (the MoE block reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = make_linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = make_linear(self.intermediate_size, hidden_size, bias=False)
        self.ops: TorchLayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class FusedExperts(nn.Module):
    """This rank's routed experts as two stacked weights (vLLM's ``w13``/``w2`` layout).

    ``w13_weight`` [E_local, 2 I_local, H] (each expert's gate rows, then its up rows) and ``w2_weight``
    [E_local, H, I_local]. Under TP ``I_local = I / tp`` and ``E_local = E``; with expert parallelism
    ``E_local = E / tp`` whole experts, from ``first_expert`` on (MXFP4 under TP: `ExpertQuant.rank_width`, whole
    blocks of 32 with the tail zero-padded). With ``expert_bias`` (gpt-oss) also
    ``w13_bias`` [E_local, 2 I_local] and ``w2_bias`` [E_local, H] (whole on every rank: under TP only rank 0
    adds it, so the all-reduce counts it once).

    Quantised experts (``cfg.weight_quant``) keep the checkpoint's format: FP8 blocks hold ``w13_weight`` /
    ``w2_weight`` as float8_e4m3fn of those shapes with ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``
    [E_local, N / bn, K / bk] float32; MXFP4 holds the E2M1 codes two a byte, [E_local, N, K / 2] uint8, with
    ``w13_weight_scale`` / ``w2_weight_scale`` [E_local, N, K / 32] E8M0; FP8 rows hold float8_e4m3fn values with
    ``*_weight_scale`` [E_local, N] float32 (and ``*_weight_input_scale`` [1] for static activations); int4
    holds ``*_weight`` [E_local, K / 8, N] int32 words with ``*_weight_scales`` [E_local, G, N] (and
    ``*_weight_zeros``, ``*_weight_g_idx``: `pd_cluster.engine.quant.experts.quantized_storage`). `w13` and `w2`
    give either form to the fused MoE (`pd_cluster.engine.quant.experts.QuantizedExperts`).

    Raises:
        ValueError: quantised experts whose shapes the format cannot hold (`ExpertQuant.check_shapes`).
    """

    def __init__(self, hidden_size: int, cfg: MoEConfig, tp: TPGroup, expert_parallel: bool) -> None:
        super().__init__()
        self.expert_parallel = expert_parallel and tp.size > 1
        split = 1 if self.expert_parallel else tp.size
        self.num_local_experts = cfg.num_experts // tp.size if self.expert_parallel else cfg.num_experts
        self.first_expert = tp.rank * self.num_local_experts if self.expert_parallel else 0
        self.quant = cfg.weight_quant
        self.intermediate_size = (self.quant.rank_width(cfg.intermediate_size, split) if self.quant
                                  else cfg.intermediate_size // split)
        e, i, h = self.num_local_experts, self.intermediate_size, hidden_size
        if self.quant is None:
            self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))
            self.w2_weight = nn.Parameter(torch.empty(e, h, i))
        else:
            self.quant.check_shapes(hidden_size, i)
            act_order = self.quant.scheme is not None and self.quant.scheme.act_order
            for name, (n, k) in (("w13_weight", (2 * i, h)), ("w2_weight", (h, i))):
                # int4 with act order: every rank keeps the scales of every group of down's whole width
                scale_k = cfg.intermediate_size if act_order and name == "w2_weight" else k
                for suffix, t in quantized_storage(self.quant, e, n, k, scale_k).items():
                    setattr(self, name + suffix, nn.Parameter(t, requires_grad=False))
        if cfg.expert_bias:
            self.w13_bias = nn.Parameter(torch.zeros(e, 2 * i))
            self.w2_bias = nn.Parameter(torch.zeros(e, h))
        else:
            self.w13_bias = self.w2_bias = None
        self.adds_down_bias = self.expert_parallel or tp.rank == 0
        self.act_dtype = torch.get_default_dtype()  # the model's dtype (the loader builds under it)

    @property
    def w13(self) -> torch.Tensor | QuantizedExperts:
        """The gate/up projections: ``w13_weight``, or it with its scales when quantised."""
        return self._stacked("w13_weight")

    @property
    def w2(self) -> torch.Tensor | QuantizedExperts:
        """The down projections, as `w13`."""
        return self._stacked("w2_weight")

    def _stacked(self, name: str) -> torch.Tensor | QuantizedExperts:
        data = getattr(self, name)
        if self.quant is None:
            return data
        return QuantizedExperts(data, getattr(self, name + self.quant.scale_suffix), self.quant,
                                getattr(self, name + "_zeros", None), getattr(self, name + "_g_idx", None),
                                getattr(self, name + "_input_scale", None))

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for its routed experts (values, scales, biases)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids [T, k] as this rank's indices, -1 where another rank holds the expert."""
        if not self.expert_parallel:
            return ids
        local = ids - self.first_expert
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1)


class SparseMoE(nn.Module):
    """One MoE MLP block: ``experts(x) + shared(x)``, reduced over the TP group once.

    Args:
        hidden_size: the model's width.
        cfg: the MoE shape and routing.
        tp: the tensor-parallel group.
        expert_parallel: hold whole experts, ``E / tp.size`` per rank, instead of a slice of every expert.

    `forward(x [T, H]) -> [T, H]` in x's dtype.

    Raises:
        ValueError: the TP size does not divide the expert width (TP) or the expert count (EP).
    """

    def __init__(self, hidden_size: int, cfg: MoEConfig, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        check_moe_parallel(cfg, tp.size, expert_parallel)
        self.cfg = cfg
        self.tp = tp
        self.gate = Router(hidden_size, cfg.routing)
        self.experts = FusedExperts(hidden_size, cfg, tp, expert_parallel)
        # DP attention with expert parallelism: tokens go only to the ranks of their experts (routed all-to-all),
        # and the shared experts are whole on every rank, run on the rank's own tokens
        self.routed = tp.gathers_tokens and self.experts.expert_parallel
        self.shared_experts = (SharedExperts(hidden_size, cfg.shared_intermediate_size, SINGLE if self.routed else tp)
                               if cfg.shared_intermediate_size else None)
        self.shared_expert_gate = make_linear(hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        self.activation = ((cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.activation == "swiglu_clamped"
                           else ("silu",))
        self.ops: TorchLayerOps = TORCH_OPS
        # EPLB (`pd_cluster.engine.model.eplb.setup_eplb`): the placement of logical experts on physical slots and
        # their load counts; None without redundant experts or rebalancing
        self.location = None
        self.expert_params: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.gathers_tokens:
            return self.tp.all_reduce(self._partial(x))
        # DP attention (`pd_cluster.engine.parallel.dp_attention.DPMoEGroup`)
        if self.routed:  # each token to the ranks of its experts and back, then the shared experts here
            weights, ids = self._route(x)
            received, r_weights, r_ids = self.tp.dispatch_routed(x, weights, ids, self.experts.num_local_experts)
            return self._with_shared(x, self.tp.combine_routed(self._routed_experts(received, r_weights, r_ids),
                                                               x.shape[0]))
        gathered = self.tp.dispatch(x)  # every DP rank's tokens in, this rank's rows of the summed output back
        if gathered.shape[0] == 0:
            return x  # no rank has a token this step (an idle step everywhere)
        return self.tp.combine(self._partial(gathered))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.gate(x)
        if self.cfg.routing.weights_in_activation_dtype:
            weights = weights.to(x.dtype)
        if self.location is not None:  # EPLB: count the logical choices, then pick each one's physical replica
            self.location.record(ids)
            ids = self.location.to_physical(ids)
        return weights, ids

    def _routed_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's routed experts' weighted sum for x [T, H] chosen as `ids` [T, k] (global) with `weights`;
        the other ranks' experts give zeros."""
        if x.shape[0] == 0:
            return x.clone()
        ex = self.experts
        return self.ops.fused_experts(x, ex.w13, ex.w2, weights, ex.local_ids(ids),
                                      self.cfg.routing.apply_weights_on_input, ex.w13_bias,
                                      ex.w2_bias if ex.adds_down_bias else None, self.activation)

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output for x [T, H]: its experts (or its slice of each) and its slice
        of the shared experts, before the sum over the group."""
        return self._with_shared(x, self._routed_experts(x, *self._route(x)))

    def _with_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus the shared experts' output for x (gated where the model gates it)."""
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def warm_up_kernels(self) -> None:
        """Compile the expert kernels' large-batch variant now (`engine.graph.warm_up_kernels`); no collective."""
        ex = self.experts
        self.ops.warm_up_experts(ex.w13, ex.w2, self.cfg.top_k, ex.act_dtype, ex.w13_bias, ex.w2_bias,
                                 self.activation)

