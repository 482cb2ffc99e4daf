"""The Triton MLA backend: the GPU path of multi-head latent attention.

Per layer: the store kernel writes the step's latents (FP8 with a clamp;
`pd_cluster.engine.attention.triton.store`, one plane), the decode rows run the
paged absorbed-MLA kernel (`pd_cluster.engine.attention.triton.mla_decode`), and
prefill chunks run the expanded form shared by every MLA backend (latents
up-projected by ``kv_b_proj``, then torch's fused scaled-dot-product attention;
`MLAAttentionBackend._prefill`). `prepare` computes the decode split counts on the
device, so a decode step makes no host sync and is captured in CUDA graphs
(`prepare_for_capture` gives it static buffers), like `TritonAttentionBackend`.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is how CI
tests them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.attention.mla import MLAAttentionBackend
from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig, DecodeWorkspace, max_splits_for, num_kv_splits
from pd_cluster.engine.attention.triton.mla_decode import mla_decode_attention, mla_head_blocks
from pd_cluster.engine.attention.triton.store import store_kv
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.attention.triton_backend import DEFAULT_NUM_SMS_OFF_GPU

# A latent tile is BLOCK_N x 576 values: 32 tokens keep it and the [16, 512] float32 accumulator in registers.
MLA_DECODE_DEFAULTS = DecodeKernelConfig(block_n=32, num_warps=4, num_stages=2)


@dataclass
class _Static:
    """Decode buffers that outlive a step, so that CUDA graphs bake in their addresses."""

    max_bs: int
    num_splits: torch.Tensor  # [max_bs] int32
    mid: torch.Tensor  # flat float32 for every batch size up to max_bs


class TritonMLABackend(MLAAttentionBackend):
    """MLA in Triton (module docstring; contract: `MLAAttentionBackend`).

    Args:
        num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale: as the base class.
        decode: decode kernel settings; num_sms: multiprocessors to size the split grid for (None: the device's).
    """

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, decode: DecodeKernelConfig | None = None,
                 num_sms: int | None = None) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale)
        self.config = decode or MLA_DECODE_DEFAULTS
        self._num_sms = num_sms
        self._static: _Static | None = None
        self._step: tuple[ForwardBatch, DecodeWorkspace | None] | None = None

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Plan the step's decode: split counts on the device, partial buffers."""
        nd = batch.num_decodes
        self._step = (batch, self._workspace(batch.seq_lens[:nd], nd) if nd else None)

    def store(self, layer: int, latent: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> None:
        cache = pool.latent_cache(layer).unsqueeze(1)  # [pages + 1, 1, page_size, D]: one "head"
        store_kv(latent.unsqueeze(1), None, cache, None, batch.slot_mapping, pool.layer_scales(layer)[0], 1.0)

    def decode(self, layer: int, q_abs: torch.Tensor, pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        if self._step is None or self._step[0] is not batch:
            self.prepare(batch, pool)
        nd = q_abs.shape[0]
        out = torch.empty(nd, self.num_heads, self.kv_lora_rank, dtype=q_abs.dtype, device=q_abs.device)
        mla_decode_attention(q_abs, pool.latent_cache(layer), batch.block_tables[:nd], batch.seq_lens[:nd], out,
                             self._step[1], self.kv_lora_rank, self.scale, pool.layer_scales(layer)[0], self.config)
        return out

    # ---- CUDA graphs ---------------------------------------------------------
    def prepare_for_capture(self, max_bs: int, device: torch.device) -> None:
        """Static decode buffers for batches up to `max_bs`, allocated before any capture."""
        self._sms(device)
        floats = max(self._mid_floats(bs) for bs in range(1, max_bs + 1))
        self._static = _Static(max_bs, torch.ones(max_bs, dtype=torch.int32, device=device),
                               torch.zeros(floats, dtype=torch.float32, device=device))

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Nothing: the split counts are computed inside the graph from the static `seq_lens`."""

    # ---- helpers ---------------------------------------------------------------
    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                             if device.type == "cuda" else DEFAULT_NUM_SMS_OFF_GPU)
        return self._num_sms

    def _max_splits(self, bs: int) -> int:
        return max_splits_for(bs, mla_head_blocks(self.num_heads), self._num_sms, self.config)

    def _mid_floats(self, bs: int) -> int:
        return bs * self.num_heads * self._max_splits(bs) * (self.kv_lora_rank + 1)

    def _workspace(self, seq_lens: torch.Tensor, nd: int) -> DecodeWorkspace:
        self._sms(seq_lens.device)
        s, h, r = self._max_splits(nd), self.num_heads, self.kv_lora_rank
        static = self._static
        if static is not None and nd <= static.max_bs and static.mid.device == seq_lens.device:
            splits = num_kv_splits(seq_lens, s, self.config, out=static.num_splits[:nd])
            mid = static.mid[: nd * h * s * (r + 1)]
        else:
            splits = num_kv_splits(seq_lens, s, self.config)
            mid = torch.empty(nd * h * s * (r + 1), dtype=torch.float32, device=seq_lens.device)
        return DecodeWorkspace(splits, mid[: nd * h * s * r].view(nd, h, s, r), mid[nd * h * s * r:].view(nd, h, s), s)
