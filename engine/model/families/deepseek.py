"""DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``; also Kimi K2's shape): multi-head
latent attention (`MLAConfig`: a low-rank query when ``q_lora_rank`` is set, else a direct one; RoPE on
interleaved pairs, always in V2, in V3 unless ``rope_interleave`` is false; YaRN with ``mscale_all_dim``
folded into the softmax scale), and routed plus shared experts on the layers ``i >= first_k_dense_replace``
with ``i % moe_layer_freq == 0`` (DeepSeek's rule; transformers 5.24 ignores ``moe_layer_freq``, 1 in every
released checkpoint):

* V2: softmax scores, ``topk_method`` ``greedy`` or ``group_limited_greedy`` (groups scored by their best
  expert), ``routed_scaling_factor``;
* V3: sigmoid scores with ``e_score_correction_bias`` choosing (never weighting), ``noaux_tc`` grouped top-k
  (groups scored by their best two), ``norm_topk_prob``, ``routed_scaling_factor``.

Layers past ``num_hidden_layers`` (V3's multi-token-prediction layer) are not read by the model, as transformers
does; ``--speculative-algorithm NEXTN`` loads the first as its drafter (`pd_cluster.engine.model.nextn`).

Sources: transformers 5.24 ``DeepseekV2Config``/``DeepseekV2TopkRouter``, ``DeepseekV3Config``/
``DeepseekV3TopkRouter``; DeepSeek-V3 technical report sec. 2.1.2.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.mla_config import MLAConfig
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig

# topk_method -> grouped; each with the scoring function it is defined for
TOPK_METHODS = {"greedy": (False, None), "group_limited_greedy": (True, "softmax"), "noaux_tc": (True, "sigmoid")}


def deepseek_moe_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0`` (DeepSeek's rule)."""
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i >= first_dense and i % freq == 0)


def routing_method(cfg: dict[str, Any], v3: bool) -> tuple[str, str]:
    """(scoring function, top-k method), with each version's defaults.

    Raises:
        ValueError: an unknown method, or one with a scoring function it is not defined for, named.
    """
    scoring = str(cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
    method = str(cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"))
    if method not in TOPK_METHODS:
        raise ValueError(f"unsupported topk_method {method!r}; supported: {', '.join(TOPK_METHODS)}")
    needs = TOPK_METHODS[method][1]
    if needs is not None and scoring != needs:
        raise ValueError(f"topk_method {method!r} with scoring_func {scoring!r} is not implemented")
    return scoring, method


def deepseek_moe(cfg: dict[str, Any], v3: bool) -> MoEConfig | None:
    """The routed and shared experts of a DeepSeek-style config (V3's routing when `v3`, else V2's); None
    without routed experts.

    Raises:
        ValueError: a top-k method or scoring function the engine does not implement, named.
    """
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return None
    scoring, method = routing_method(cfg, v3)
    grouped = TOPK_METHODS[method][0]
    routing = RoutingConfig(
        experts, int(cfg.get("num_experts_per_tok") or 1), scoring,  # type: ignore[arg-type]
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        n_group=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        group_score="top2_sum" if method == "noaux_tc" else "max",
        e_score_correction_bias=method == "noaux_tc",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        router_fp32=True)
    inter = int(cfg["moe_intermediate_size"])
    return MoEConfig(experts, inter, routing, deepseek_moe_layers(cfg),
                     shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
                     activation=str(cfg.get("hidden_act", "silu")))


class DeepseekV3(Family):
    architecture = "DeepseekV3ForCausalLM"
    name = "deepseek_v3"
    v3 = True

    def mla(self, cfg: dict[str, Any], scaling: dict[str, Any] | None) -> MLAConfig | None:
        return MLAConfig.from_dict(cfg, scaling, not self.v3 or bool(cfg.get("rope_interleave", True)))

    def moe(self, cfg: dict[str, Any]) -> MoEConfig | None:
        return deepseek_moe(cfg, self.v3)


class DeepseekV2(DeepseekV3):
    architecture = "DeepseekV2ForCausalLM"
    name = "deepseek_v2"
    v3 = False


FAMILIES = (DeepseekV2(), DeepseekV3())
