"""Every linear layer of a model by its checkpoint name, with its shape and how tensor parallelism splits it.
Torch-free: the planner counts quantised bytes from it (`pd_cluster.engine.planner.weights`) and
`ArchConfig.check_tp` checks that a TP size keeps quantisation blocks and groups whole.

The split is Megatron-LM's, as the loader applies it (`pd_cluster.engine.model.loader.shard`): column-parallel
layers (q/k/v, gate/up, MLA's q_b_proj and kv_b_proj, experts' gate/up) keep output rows, row-parallel ones
(o, down) input columns; MLA's q_a_proj and kv_a_proj_with_mqa are replicated. Routed experts are one entry per
projection with `LinearLayer.count` experts (each split like a dense layer). Names are the checkpoint's: the
model's names with the family's renames undone (`Family.checkpoint_name`), its experts named as it stores them
(`Family.expert_projections`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.model import families

ArchConfig = Any  # `pd_cluster.engine.model.arch.ArchConfig` (which imports this module)
ROWS, COLS = "rows", "cols"


@dataclass(frozen=True)
class LinearLayer:
    """One linear weight [n, k] (checkpoint module `name`), `count` of them (routed experts), split along
    `split` (``rows``, ``cols`` or None: replicated)."""

    name: str
    n: int
    k: int
    split: str | None
    count: int = 1
    expert: bool = False

    @property
    def params(self) -> int:
        return self.count * self.n * self.k


def _layer(arch: ArchConfig, i: int, projections: tuple[str, str, str] | None) -> list[LinearLayer]:
    h, p, out = arch.hidden_size, f"model.layers.{i}", []
    a = f"{p}.self_attn"
    if arch.mla is not None:
        m, heads = arch.mla, arch.num_attention_heads
        if m.q_lora_rank is None:
            out.append(LinearLayer(f"{a}.q_proj", heads * m.qk_head_dim, h, ROWS))
        else:
            out += [LinearLayer(f"{a}.q_a_proj", m.q_lora_rank, h, None),
                    LinearLayer(f"{a}.q_b_proj", heads * m.qk_head_dim, m.q_lora_rank, ROWS)]
        out += [LinearLayer(f"{a}.kv_a_proj_with_mqa", m.latent_dim, h, None),
                LinearLayer(f"{a}.kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, ROWS),
                LinearLayer(f"{a}.o_proj", h, heads * m.v_head_dim, COLS)]
    else:
        out += [LinearLayer(f"{a}.q_proj", arch.q_size, h, ROWS), LinearLayer(f"{a}.k_proj", arch.kv_size, h, ROWS),
                LinearLayer(f"{a}.v_proj", arch.kv_size, h, ROWS), LinearLayer(f"{a}.o_proj", h, arch.q_size, COLS)]
    if not arch.is_moe_layer(i):
        w = arch.intermediate_size
        gate = [LinearLayer(f"{p}.mlp.gate_proj", w, h, ROWS)] if arch.mlp_gated else []  # StarCoder2: no gate
        return out + gate + [LinearLayer(f"{p}.mlp.up_proj", w, h, ROWS), LinearLayer(f"{p}.mlp.down_proj", h, w, COLS)]
    moe = arch.moe
    e, w = moe.num_experts, moe.intermediate_size
    if projections is None:  # stacked: one tensor per projection
        out += [LinearLayer(f"{p}.mlp.experts", 2 * w, h, ROWS, e, True), LinearLayer(f"{p}.mlp.experts", h, w, COLS,
                                                                                        e, True)]
    else:
        gate, up, down = (f"{p}.mlp.experts.0.{name}" for name in projections)
        out += [LinearLayer(gate, w, h, ROWS, e, True), LinearLayer(up, w, h, ROWS, e, True),
                LinearLayer(down, h, w, COLS, e, True)]
    s = moe.shared_intermediate_size
    if s:
        out += [LinearLayer(f"{p}.mlp.shared_experts.gate_proj", s, h, ROWS),
                LinearLayer(f"{p}.mlp.shared_experts.up_proj", s, h, ROWS),
                LinearLayer(f"{p}.mlp.shared_experts.down_proj", h, s, COLS)]
    return out


def linear_layers(arch: ArchConfig) -> list[LinearLayer]:
    """The model's linear layers in checkpoint names (module docstring); no router, embeddings or LM head."""
    family = families.get(arch.architecture)
    out = []
    for i in range(arch.num_hidden_layers):
        for layer in _layer(arch, i, family.expert_projections):
            name = family.checkpoint_name(layer.name)
            out.append(LinearLayer(name, layer.n, layer.k, layer.split, layer.count, layer.expert))
    return out
