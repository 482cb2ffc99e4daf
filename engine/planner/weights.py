"""Weight bytes per GPU as the engine holds them: quantised layers at their scheme's bits, the rest at the model
dtype, each either split over the TP ranks or replicated on every one. Torch-free.

The engine's split (`pd_cluster.engine.model.loader`, Megatron-LM's): attention and MLP projections, shared
experts and routed experts (a slice of each, or whole experts with expert parallelism: the same bytes) are split
over the ranks; the embeddings, the LM head, the norms, the MoE router, an o_proj bias and MLA's ``q_a_proj`` and
``kv_a_proj_with_mqa`` are replicated. Quantised layers (the checkpoint's `QuantScheme`, asked per module by
its checkpoint name) take ``bits_per_weight`` (values and scales) when the engine keeps that kind quantised in
that place (`pd_cluster.engine.quant.support`: routed experts in FP8 blocks or MXFP4, held so by the fused MoE
kernel), else the model dtype (a dequantised layer: MLA's ``kv_b_proj``). Experts in another quantised format are
refused when the config is read (`pd_cluster.engine.quant.expert_format.expert_quant_of`). Biases and sinks are
counted with the replicated parts (an upper bound: a few MiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.linear_layers import linear_layers
from pd_cluster.engine.quant import support
from pd_cluster.engine.quant.weight_scheme import QuantScheme


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of one GPU's weights (TP rank), by kind.

    Attributes:
        quantized: layers kept quantised (values and scales).
        plain: layers at the model dtype, split over the ranks (dequantised layers included).
        replicated: what every rank holds whole (embeddings, LM head, norms, router, MLA's latent projections).
        quantized_params, params: parameters kept quantised, and all of them (whole model).
    """

    quantized: int
    plain: int
    replicated: int
    quantized_params: int
    params: int

    @property
    def total(self) -> int:
        return self.quantized + self.plain + self.replicated


def weight_bytes(arch: ArchConfig, scheme: QuantScheme | None, dtype_bytes: int, tp_size: int = 1,
                 expert_kinds_kept: frozenset[str] | None = None, attention_tp_size: int | None = None,
                 redundant_experts: int = 0) -> WeightBytes:
    """Bytes of one GPU's weights at TP `tp_size` (module docstring).

    Args:
        arch: the model.
        scheme: the checkpoint's weight quantisation, None for unquantised weights.
        dtype_bytes: bytes of one unquantised value (the model dtype).
        tp_size: the tensor-parallel size: the ranks the MLPs and experts are split over.
        expert_kinds_kept: quantised expert kinds the engine keeps (default `support.EXPERT_KINDS_KEPT`).
        attention_tp_size: the ranks the attention projections are split over, when fewer than `tp_size`: DP
            attention's ``tp_size / dp_size`` (SGLang's ``--enable-dp-attention``: each DP rank holds the
            attention of its own requests, and the ranks of one DP group split it). Default `tp_size`.
        redundant_experts: EPLB's extra physical experts (``--ep-num-redundant-experts``, with expert
            parallelism): each rank holds ``(E + R) / tp_size`` routed experts instead of ``E / tp_size``.
    """
    attention_tp = tp_size if attention_tp_size is None else attention_tp_size
    kept_experts = support.EXPERT_KINDS_KEPT if expert_kinds_kept is None else expert_kinds_kept
    quantized = plain = replicated = 0.0
    quantized_params = linear_params = 0
    for layer in linear_layers(arch):
        params, split = layer.params, layer.split is not None
        linear_params += params
        ws = scheme.for_module(layer.name) if scheme is not None else None
        kept = ws is not None and (ws.kind in kept_experts if layer.expert else ws.kind in support.DENSE_KINDS_KEPT)
        if kept and layer.name.rsplit(".", 1)[-1] in support.DEQUANTIZED_MODULES:
            kept = False
        share = params / ((attention_tp if _is_attention(layer.name) else tp_size) if split else 1)
        if layer.expert and redundant_experts:
            share *= (layer.count + redundant_experts) / layer.count
        if kept:
            quantized += share * ws.bits_per_weight() / 8
            quantized_params += params
        elif split:
            plain += share * dtype_bytes
        else:
            replicated += share * dtype_bytes
    rest = arch.num_params() - linear_params  # embeddings, LM head, norms, router, biases, sinks
    replicated += rest * dtype_bytes
    return WeightBytes(int(quantized), int(plain), int(replicated), quantized_params, arch.num_params())


def _is_attention(name: str) -> bool:
    """Whether checkpoint module `name` is an attention projection (softmax or linear attention)."""
    return ".self_attn." in name or ".linear_attn." in name
