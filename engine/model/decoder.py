"""The decoder-only model over a paged KV pool: one shell for every family (`pd_cluster.engine.model.families`).

Embeddings, a stack of pre-norm decoder layers, the final norm and the LM head. What differs between families
is read from `ArchConfig`, never from an architecture name:

* the attention block: `layers.Attention` with K and V per head (q/k/v and o biases, q/k norms, partial or
  per-layer RoPE, NoPE layers, sinks, temperature tuning, an output gate), or `mla_attention.MLAAttention` over
  one latent per token (``cfg.mla``); on ``linear`` layers a `gated_deltanet.GatedDeltaNet` instead
  (``linear_attn``), whose recurrent states the model reads from the pool's state pages once per step and writes
  back after the last layer (`KVPool.read_states`);
* the MLP: dense SwiGLU / GeGLU, or the shared MoE block `moe.SparseMoE` on ``cfg.moe``'s layers;
* the norms: their style (`ArchConfig.norm_style`) and where they sit (`ArchConfig.norm_layout`: before each
  block, Gemma's sandwich, after each block only, or one norm for attention and MLP in parallel);
* scaled embeddings and block outputs (Gemma, Granite), soft-capped, scaled or divided final logits (Gemma,
  Cohere, Granite), an LM head bias.

Each layer attends as its `LayerAttention` says and rotates with its own RoPE (one cos/sin table per step for
each distinct RoPE among the layers: Gemma 3's local and global ones), or none. q/k/v and gate/up projections
are fused into one matrix each (fewer kernel launches); `pd_cluster.engine.model.loader` fills them from the
checkpoint's separate tensors. The forward pass takes one explicit `ForwardBatch` and the `KVPool`; attention
goes through the backend. Under tensor parallelism (`TPGroup` of N ranks) each rank holds 1/N of the heads and
of the MLP width, and the o and down projections end with an all-reduce (Megatron-LM's split).
"""

from __future__ import annotations

import torch
from torch import nn

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.layer_attention import rope_key
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.gated_deltanet import GatedDeltaNet
from pd_cluster.engine.model.layer_ops import TorchLayerOps
from pd_cluster.engine.model.layers import MLP, Attention, Norm
from pd_cluster.engine.model.mla_attention import MLAAttention
from pd_cluster.engine.model.moe import SparseMoE
from pd_cluster.engine.model.rope import RotaryEmbedding, longrope_variants
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

CosSin = tuple[torch.Tensor, torch.Tensor]


def build_mlp(cfg: ArchConfig, layer: int, tp: TPGroup, expert_parallel: bool = False) -> nn.Module:
    """The MLP of `layer`: the `SparseMoE` block where ``cfg.is_moe_layer(layer)``, else the dense MLP.

    Raises:
        ValueError: the TP size does not divide the expert width (or, with `expert_parallel`, their count).
    """
    if cfg.moe is not None and cfg.is_moe_layer(layer):
        return SparseMoE(cfg.hidden_size, cfg.moe, tp.moe, expert_parallel)
    return MLP(cfg, tp)


def attention_class(cfg: ArchConfig) -> type[Attention] | type[MLAAttention]:
    """The attention block of `cfg`: latent attention under MLA, else K and V per head."""
    return MLAAttention if cfg.mla is not None else Attention


class DecoderLayer(nn.Module):
    """One decoder block. It carries the residual stream separately (vLLM's and SGLang's form): it takes
    (x, residual) and returns (block output, residual), so each residual add fuses into the next norm; the
    hidden state is their sum. By `ArchConfig.norm_layout`:

    * ``pre``: ``h = h + attn(n1(h))``, ``h = h + mlp(n2(h))``;
    * ``sandwich`` (Gemma): ``h = h + n2(attn(n1(h)))``, ``h = h + n4(mlp(n3(h)))``;
    * ``post`` (OLMo 2, EXAONE 4): ``h = h + n2(attn(h))``, ``h = h + n4(mlp(h))``;
    * ``parallel`` (Cohere): ``h = h + attn(n1(h)) + mlp(n1(h))``.

    With `ArchConfig.residual_multiplier` (Granite) each block output is multiplied by it before its add.
    """

    def __init__(self, cfg: ArchConfig, layer: int, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        norm = lambda: Norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)  # noqa: E731
        self.layout = cfg.norm_layout
        if self.layout != "post":
            self.input_layernorm = norm()
        if cfg.layer_attention[layer].kind == "linear":
            self.linear_attn = GatedDeltaNet(cfg, layer, cfg.linear_attention_layers.index(layer), tp)
        else:
            self.self_attn = attention_class(cfg)(cfg, layer, tp)
        if self.layout != "parallel":
            self.post_attention_layernorm = norm()
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.layout in ("sandwich", "post"):
            self.post_feedforward_layernorm = norm()
        self.mlp = build_mlp(cfg, layer, tp, expert_parallel)
        self.scale = cfg.residual_multiplier

    def _mix(self, x: torch.Tensor, cos_sin: CosSin | None, batch: ForwardBatch, pool: KVPool,
             backend) -> torch.Tensor:
        """The token mixer: attention, or the linear attention over the step's states (`ForwardBatch.states`)."""
        if hasattr(self, "linear_attn"):
            return self.linear_attn(x, batch, batch.states)
        return self.self_attn(x, cos_sin, batch, pool, backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin | None,
                batch: ForwardBatch, pool: KVPool, backend) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == "post":
            return self._post(x if residual is None else x + residual, cos_sin, batch, pool, backend)
        if residual is None:  # the first layer: the residual stream starts as the embeddings
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        a = self._scaled(self._mix(x, cos_sin, batch, pool, backend))
        if self.layout == "parallel":
            return self._scaled(self.mlp(x)), residual + a
        if self.layout == "pre":
            x, residual = self.post_attention_layernorm(a, residual)
            return self._scaled(self.mlp(x)), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(a), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual

    def _post(self, h: torch.Tensor, cos_sin: CosSin | None, batch: ForwardBatch, pool: KVPool,
              backend) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + self.post_attention_layernorm(self._mix(h, cos_sin, batch, pool, backend))
        return self.post_feedforward_layernorm(self.mlp(h)), h

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.scale is None else out * self.scale


class CausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        cfg: the architecture.
        tp: the tensor-parallel group (embedding, norms, routers and LM head are replicated).
        expert_parallel: MoE layers hold whole experts, E / tp.size per rank, instead of a slice of each.

    `forward(batch, pool, backend)` returns logits [len(batch.logits_indices), vocab_size] in float32; `backend`
    is an `AttentionBackend`, or an `MLAAttentionBackend` under MLA. A longrope model holds its short and long
    factor sets; each token rotates by its request's (`ForwardBatch.rope_variant`; the short ones without it).

    Raises:
        ValueError: the TP size does not divide the heads, widths or experts (`ArchConfig.check_tp`).
    """

    keep_hidden = False  # NEXTN sets it: `last_hidden` [T, hidden_size] holds the last forward's final-norm output
    last_hidden: torch.Tensor | None = None

    def __init__(self, cfg: ArchConfig, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__()
        cfg.check_tp(tp.size, expert_parallel)
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Gemma: sqrt(hidden_size), applied rounded to the activation dtype (a buffer: no host copy per step)
        self.register_buffer("embed_scale", torch.tensor(cfg.embedding_scale or 1.0, dtype=torch.float32),
                             persistent=False)
        keys: list[str] = []
        ropes: list[nn.ModuleList] = []  # per distinct RoPE: its variants (longrope: short, long)
        self.layer_rope: list[int] = []  # index into self.ropes, -1 for a NoPE layer
        for spec in cfg.layer_attention:
            key = rope_key(spec)
            if key is not None and key not in keys:
                keys.append(key)
                ropes.append(nn.ModuleList(RotaryEmbedding(cfg.rotary_dim, spec.rope_theta, scaling,
                                                           cfg.max_position_embeddings)
                                           for scaling in longrope_variants(spec.rope_scaling)))
            self.layer_rope.append(-1 if key is None else keys.index(key))
        self.ropes = nn.ModuleList(ropes)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, expert_parallel) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def layer_ops(self) -> TorchLayerOps:
        return self.norm.ops

    def set_layer_ops(self, ops: TorchLayerOps) -> None:
        """Run the layers' norms, RoPE and activations through `ops` (`pd_cluster.engine.model.layer_ops`)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The loader's hook: `tensor` (this rank's shard of checkpoint tensor `name`, ``model.`` removed) as the
        module holds it (the attention block's row order: `Attention.checkpoint_tensor`,
        `MLAAttention.checkpoint_tensor`)."""
        if ".linear_attn." in name:
            return GatedDeltaNet.checkpoint_tensor(self.cfg, self.tp, name, tensor)
        return attention_class(self.cfg).checkpoint_tensor(self.cfg, name, tensor)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, backend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        if self.cfg.embedding_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        dtype = self.layer_ops.cos_sin_dtype(x.dtype)
        tables = [self._cos_sin(variants, batch, dtype) for variants in self.ropes]
        backend.prepare(batch, pool)
        state_tables = self._read_states(batch, pool)
        residual = None
        for layer, rope in zip(self.layers, self.layer_rope):
            x, residual = layer(x, residual, tables[rope] if rope >= 0 else None, batch, pool, backend)
        if state_tables is not None:
            pool.write_states(state_tables, batch.states)
        rows = batch.logits_indices
        if self.keep_hidden:  # NEXTN: every token's final-norm output, read by the MTP drafter
            self.last_hidden = self.norm(x) if residual is None else self.norm(x, residual)[0]
            return self._final_logits(self.lm_head(self.last_hidden[rows])).float()
        x = self.norm(x[rows]) if residual is None else self.norm(x[rows], residual[rows])[0]
        return self._final_logits(self.lm_head(x)).float()

    @property
    def has_recurrent_state(self) -> bool:
        """Some layer keeps a recurrent state per request (linear attention)."""
        return self.cfg.linear is not None and bool(self.cfg.linear_attention_layers)

    def _read_states(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor | None:
        """Put the step's recurrent states [B, floats] float32 in ``batch.states``, read from each request's
        pages of the pool's state group; returns those pages' block tables [B, n] to write them back to, or
        None (no linear layers; or a step without the state group's tables, the kernels' warm-up: zeros, not
        written back)."""
        if not self.has_recurrent_state:
            return None
        floats = self.cfg.linear.state_floats(self.tp.size) * len(self.cfg.linear_attention_layers)
        group = pool.groups.state_group
        if group is None or not group or batch.group_batches is None or len(batch.group_batches) < group:
            batch.states = torch.zeros(batch.num_reqs, floats, dtype=torch.float32, device=batch.input_ids.device)
            return None
        tables = batch.for_group(group).block_tables
        batch.states = pool.read_states(tables, floats)
        return tables

    @staticmethod
    def _cos_sin(variants: nn.ModuleList, batch: ForwardBatch, dtype: torch.dtype) -> CosSin:
        """The step's cos/sin of one RoPE; for longrope each token's from its request's factor set."""
        short = variants[0].cos_sin(batch.positions, dtype)
        if len(variants) == 1 or batch.rope_variant is None:
            return short
        long = variants[1].cos_sin(batch.positions, dtype)
        use_long = batch.rope_variant[:, None].bool()
        return torch.where(use_long, long[0], short[0]), torch.where(use_long, long[1], short[1])

    def _final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Soft-capped (Gemma 2), multiplied (Cohere) or divided (Granite), in the activation dtype as
        transformers does."""
        cfg = self.cfg
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        if cfg.logit_scale is not None:
            logits = logits * cfg.logit_scale
        if cfg.logit_divisor is not None:
            logits = logits / cfg.logit_divisor
        return logits
