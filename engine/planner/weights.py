"""Weight bytes per GPU as the engine holds them: quantised layers at their scheme's bits, the rest at the model
dtype, each either split over the TP ranks or replicated on every one. Torch-free.

The engine's split (`pd_cluster.engine.model.loader`, Megatron-LM's): attention and MLP projections, shared
experts and routed experts (a slice of each, or whole experts with expert parallelism: the same bytes) are split
over the ranks; the embeddings, the LM head, the norms, the MoE router, an o_proj bias and MLA's ``q_a_proj`` and
``kv_a_proj_with_mqa`` are replicated. Quantised layers (the checkpoint's `QuantScheme`, asked per module by
its checkpoint name) take ``bits_per_weight`` (values and scales) when the engine keeps that kind quantised in
that place (`pd_cluster.engine.quant.support`), else the model dtype (a dequantised layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.engine.model import families
from pd_cluster.engine.model.arch import ArchConfig
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


def _linear_modules(arch: ArchConfig) -> list[tuple[str, int, bool, bool]]:
    """(checkpoint module name, parameters, split over the ranks, a routed expert) of every linear layer's weight."""
    h, out = arch.hidden_size, []
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}"
        if arch.mla is not None:
            m, heads = arch.mla, arch.num_attention_heads
            if m.q_lora_rank is None:
                out.append((f"{p}.self_attn.q_proj", h * heads * m.qk_head_dim, True, False))
            else:
                out += [(f"{p}.self_attn.q_a_proj", h * m.q_lora_rank, False, False),
                        (f"{p}.self_attn.q_b_proj", m.q_lora_rank * heads * m.qk_head_dim, True, False)]
            out += [(f"{p}.self_attn.kv_a_proj_with_mqa", h * m.latent_dim, False, False),
                    (f"{p}.self_attn.kv_b_proj", m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim), True,
                     False),
                    (f"{p}.self_attn.o_proj", heads * m.v_head_dim * h, True, False)]
        else:
            out += [(f"{p}.self_attn.q_proj", h * arch.q_size, True, False),
                    (f"{p}.self_attn.k_proj", h * arch.kv_size, True, False),
                    (f"{p}.self_attn.v_proj", h * arch.kv_size, True, False),
                    (f"{p}.self_attn.o_proj", arch.q_size * h, True, False)]
        moe = arch.moe if arch.is_moe_layer(i) else None
        if moe is None:
            out += [(f"{p}.mlp.{n}", h * arch.intermediate_size, True, False) for n in ("gate_proj", "up_proj",
                                                                                       "down_proj")]
            continue
        expert = families.get(arch.architecture).expert_module.format(layer=i)  # the family's expert module name
        out.append((expert, moe.num_experts * 3 * h * moe.intermediate_size, True, True))
        if moe.shared_intermediate_size:
            out += [(f"{p}.mlp.shared_experts.{n}", h * moe.shared_intermediate_size, True, False)
                    for n in ("gate_proj", "up_proj", "down_proj")]
    return out


def weight_bytes(arch: ArchConfig, scheme: QuantScheme | None, dtype_bytes: int, tp_size: int = 1,
                 expert_kinds_kept: frozenset[str] | None = None) -> WeightBytes:
    """Bytes of one GPU's weights at TP `tp_size` (module docstring).

    Args:
        arch: the model.
        scheme: the checkpoint's weight quantisation, None for unquantised weights.
        dtype_bytes: bytes of one unquantised value (the model dtype).
        tp_size: the tensor-parallel size.
        expert_kinds_kept: quantised expert kinds the engine keeps (default `support.EXPERT_KINDS_KEPT`).
    """
    kept_experts = support.EXPERT_KINDS_KEPT if expert_kinds_kept is None else expert_kinds_kept
    quantized = plain = replicated = 0.0
    quantized_params = linear_params = 0
    for name, params, split, expert in _linear_modules(arch):
        linear_params += params
        ws = scheme.for_module(name) if scheme is not None else None
        kept = ws is not None and (ws.kind in kept_experts if expert else ws.kind in support.DENSE_KINDS_KEPT)
        if kept and name.rsplit(".", 1)[-1] in support.DEQUANTIZED_MODULES:
            kept = False
        share = params / (tp_size if split else 1)
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
