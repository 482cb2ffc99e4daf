"""Multi-head latent attention (MLA) over a latent KV pool: the backend contract and the torch reference.

MLA (DeepSeek-AI, "DeepSeek-V2", 2024, sec. 2.1) caches per token and layer one
latent ``[c, k_pe]``: ``c`` = RMSNorm(W_DKV x) of width ``kv_lora_rank`` and the
shared RoPE key ``k_pe`` of width ``qk_rope_head_dim``. Head ``h``'s key is
``[W_UK_h c, k_pe]`` and its value ``W_UV_h c``, where W_UK and W_UV are the two
halves of ``kv_b_proj``. Attention is computed in one of two equal forms:

* **expanded** (prefill chunks): up-project every context latent into per-head
  K and V, then ordinary causal attention; the cheap form when queries are many.
* **absorbed** (decodes): fold W_UK into the query, ``q_abs = [q_nope W_UK_h, q_pe]``
  (width ``kv_lora_rank + qk_rope_head_dim``), attend over the latents themselves
  as one shared KV head (keys: the whole latent; values: ``c``), and apply W_UV to
  the result. Each step reads every cached latent once, for all heads: the
  memory-bound form decode needs. vLLM's ``MLACommonImpl`` and SGLang's
  ``DeepseekV2AttentionMLA`` make the same split.

Both forms read the latents back from the pool after storing them, so prefill,
chunked prefill, decode and transferred pages see the same (possibly FP8) values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool


class MLAAttentionBackend(ABC):
    """Paged MLA over a `KVPool` with ``kv_format`` ``mla`` (the contract of every MLA backend).

    Args:
        num_heads: query heads of this TP rank.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: the MLA shape (`MLAConfig`).
        scale: softmax scale (`MLAConfig.softmax_scale`).

    A backend implements `store` (latents into their slots) and `decode` (absorbed attention of the decode
    rows); the expanded prefill attention and the W_UK / W_UV products are shared here.
    """

    name = "base"
    supports_cuda_graph = False

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Per-step set-up shared by all layers; the default does nothing."""

    def forward(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_b_weight: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        """Store the step's latents at ``batch.slot_mapping`` and attend (absorbed for decodes, expanded for
        prefill chunks).

        Args:
            layer: layer index into the pool.
            q_nope: [T, H, qk_nope_head_dim]; q_pe: [T, H, qk_rope_head_dim] (RoPE applied).
            latent: [T, kv_lora_rank + qk_rope_head_dim], ``c`` (normalised) then ``k_pe`` (RoPE applied).
            kv_b_weight: [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank], this rank's ``kv_b_proj`` weight.

        Returns:
            [T, H * v_head_dim] in q's dtype. Rows of padded tokens (slot -1) are unspecified.
        """
        self.store(layer, latent, pool, batch)
        t, h = q_nope.shape[0], self.num_heads
        out = torch.empty(t, h, self.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        w = kv_b_weight.view(h, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]
        nd = batch.num_decodes
        if nd:
            q_latent = torch.bmm(q_nope[:nd].transpose(0, 1), w_uk).transpose(0, 1)  # [nd, H, kv_lora_rank]
            q_abs = torch.cat((q_latent, q_pe[:nd]), dim=-1)
            o_latent = self.decode(layer, q_abs, pool, batch)  # [nd, H, kv_lora_rank]
            out[:nd] = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        if batch.num_prefills:
            self._prefill(layer, q_nope, q_pe, kv_b_weight, pool, batch, out)
        return out.view(t, -1)

    @abstractmethod
    def store(self, layer: int, latent: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> None:
        """Write `latent` [T, latent_dim] at ``batch.slot_mapping`` (-1: skipped)."""

    @abstractmethod
    def decode(self, layer: int, q_abs: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        """Absorbed attention of the decode rows ``[:num_decodes]``.

        Args:
            q_abs: [nd, H, latent_dim] absorbed queries (``q_nope W_UK``, then ``q_pe``).

        Returns:
            [nd, H, kv_lora_rank]: softmax(q_abs . latents * scale) . c, in q's dtype.
        """

    def _prefill(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                 pool: KVPool, batch: ForwardBatch, out: torch.Tensor) -> None:
        """Expanded attention of each prefill chunk over its request's latents (read back from the pool)."""
        r, nope, h = self.kv_lora_rank, self.qk_nope_head_dim, self.num_heads
        qsl = batch.query_start_loc_cpu
        for i in range(batch.num_decodes, batch.num_reqs):
            lo, hi = qsl[i], qsl[i + 1]
            seq_len, q_len = batch.seq_lens_cpu[i], hi - lo
            pages = -(-seq_len // pool.page_size)
            lat = pool.gather_latent(layer, batch.block_tables[i:i + 1, :pages])[0, :seq_len].to(q_nope.dtype)
            kv = F.linear(lat[:, :r], kv_b_weight).view(seq_len, h, nope + self.v_head_dim)
            k = torch.cat((kv[..., :nope], lat[:, None, r:].expand(seq_len, h, self.qk_rope_head_dim)), dim=-1)
            q = torch.cat((q_nope[lo:hi], q_pe[lo:hi]), dim=-1)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # [q_len, S], causal
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                               kv[..., nope:].transpose(0, 1), attn_mask=allowed, scale=self.scale)
            out[lo:hi] = o.transpose(0, 1)


class TorchMLABackend(MLAAttentionBackend):
    """The reference: latents gathered from the pool, absorbed decode as padded batched matmuls."""

    name = "torch"

    def store(self, layer: int, latent: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> None:
        pool.store_latent(layer, latent, batch.slot_mapping)

    def decode(self, layer: int, q_abs: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        nd = q_abs.shape[0]
        pages = -(-max(batch.seq_lens_cpu[:nd]) // pool.page_size)
        lat = pool.gather_latent(layer, batch.block_tables[:nd, :pages]).to(q_abs.dtype)  # [nd, L, D]
        scores = torch.matmul(q_abs, lat.transpose(1, 2)).float() * self.scale  # [nd, H, L]
        invalid = torch.arange(lat.shape[1], device=lat.device)[None, :] >= batch.seq_lens[:nd, None]
        scores.masked_fill_(invalid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = probs.masked_fill(batch.seq_lens[:nd, None, None] == 0, 0.0).to(q_abs.dtype)  # no context: zeros
        return torch.matmul(probs, lat[..., :self.kv_lora_rank])


_MLA_BACKENDS = {
    "torch": ("pd_cluster.engine.attention.mla", "TorchMLABackend"),
    "triton": ("pd_cluster.engine.attention.mla_triton", "TritonMLABackend"),
}


def mla_backend_name(attention_backend: str) -> str:
    """The MLA backend serving a resolved ``--attention-backend`` name: ``triton`` stays, the others
    (``torch``, ``cpu``: its compiled kernel is for K/V pools) run the torch reference."""
    return "triton" if attention_backend == "triton" else "torch"


def get_mla_backend(attention_backend: str, **kwargs) -> MLAAttentionBackend:
    """Instantiate the MLA backend for a resolved ``--attention-backend`` name (see `mla_backend_name`)."""
    from importlib import import_module

    module, cls = _MLA_BACKENDS[mla_backend_name(attention_backend)]
    return getattr(import_module(module), cls)(**kwargs)
