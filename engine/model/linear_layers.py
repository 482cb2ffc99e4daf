"""Every linear layer of a model by its checkpoint name, with its shape and how tensor parallelism splits it.
Torch-free: the planner counts quantised bytes from it (`pd_cluster.engine.planner.weights`) and
`ArchConfig.check_tp` checks that a TP size keeps quantisation blocks and groups whole.

The split is Megatron-LM's, as the loader applies it (`pd_cluster.engine.model.loader.shard`): column-parallel
layers (q/k/v, gate/up, MLA's q_b_proj and kv_b_proj, experts' gate/up) keep output rows, row-parallel ones
(o, down) input columns; MLA's q_a_proj and kv_a_proj_with_mqa and the LM head are replicated. Routed experts
are one entry per projection with `LinearLayer.count` experts (each split like a dense layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def _mlp_prefix(arch: ArchConfig) -> str:
    return "feed_forward" if arch.architecture.startswith("Llama4") else "mlp"


def _experts(arch: ArchConfig, p: str, hidden: int) -> list[LinearLayer]:
    moe = arch.moe
    e, i = moe.num_experts, moe.intermediate_size
    if arch.architecture in ("GptOssForCausalLM",) or arch.architecture.startswith("Llama4"):
        stacked = f"{p}.{_mlp_prefix(arch)}.experts"  # one stacked tensor per projection
        return [LinearLayer(stacked, 2 * i, hidden, ROWS, e, True), LinearLayer(stacked, hidden, i, COLS, e, True)]
    if arch.architecture == "MixtralForCausalLM":
        names = [f"{p}.block_sparse_moe.experts.0.{w}" for w in ("w1", "w3", "w2")]
    else:
        names = [f"{p}.mlp.experts.0.{w}" for w in ("gate_proj", "up_proj", "down_proj")]
    return [LinearLayer(names[0], i, hidden, ROWS, e, True), LinearLayer(names[1], i, hidden, ROWS, e, True),
            LinearLayer(names[2], hidden, i, COLS, e, True)]


def linear_layers(arch: ArchConfig) -> list[LinearLayer]:
    """The model's linear layers in checkpoint names (module docstring); no router, embeddings or LM head."""
    h, out = arch.hidden_size, []
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}"
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
        mlp = f"{p}.{_mlp_prefix(arch)}"
        if not arch.is_moe_layer(i):
            w = arch.intermediate_size
            out += [LinearLayer(f"{mlp}.gate_proj", w, h, ROWS), LinearLayer(f"{mlp}.up_proj", w, h, ROWS),
                    LinearLayer(f"{mlp}.down_proj", h, w, COLS)]
            continue
        out += _experts(arch, p, h)
        s = arch.moe.shared_intermediate_size
        if s:
            shared = f"{mlp}.shared_expert" if arch.architecture.startswith("Llama4") else f"{mlp}.shared_experts"
            out += [LinearLayer(f"{shared}.gate_proj", s, h, ROWS), LinearLayer(f"{shared}.up_proj", s, h, ROWS),
                    LinearLayer(f"{shared}.down_proj", h, s, COLS)]
    return out
