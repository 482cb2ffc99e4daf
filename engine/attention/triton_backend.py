"""The Triton attention backend: the GPU fast path for prefill and decode workers.

Per layer, `forward` runs the store kernel (K/V into their slots, FP8 with a
clamp) and then attention over what the pool now holds, exactly the torch
reference's semantics (`pd_cluster.engine.attention.torch_ref`): decode requests
(``[:num_decodes]``) through paged flash-decoding, prefill chunks through the
extend kernel. `prepare` runs once per step and computes the decode split
counts on the device, so a decode step makes no host sync and can be captured
in a CUDA graph (`pd_cluster.engine.graph`), which calls `prepare_for_capture` once to
give the backend static buffers.

The kernels also run under Triton's interpreter (``TRITON_INTERPRET=1``) on
CPU tensors, which is how CI tests them; set the variable before importing
this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.attention.triton.decode import (
    DecodeKernelConfig, DecodeWorkspace, decode_attention, max_splits_for, num_kv_splits,
)
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig, extend_attention
from pd_cluster.engine.attention.triton.store import store_kv
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool

DEFAULT_NUM_SMS_OFF_GPU = 8  # grid sizing under the interpreter, where there are no multiprocessors


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Kernel launch settings of the backend.

    Attributes:
        decode: decode (flash-decoding) kernel settings.
        extend: prefill/extend kernel settings.
        store_num_warps: warps of the KV store kernel.
        num_sms: multiprocessors to size the split-KV grid for; None reads the device.
    """

    decode: DecodeKernelConfig = field(default_factory=DecodeKernelConfig)
    extend: ExtendKernelConfig = field(default_factory=ExtendKernelConfig)
    store_num_warps: int = 4
    num_sms: int | None = None


@dataclass
class _StepPlan:
    """What `prepare` worked out for one step (device tensors and host constants only)."""

    batch: ForwardBatch
    decode_ws: DecodeWorkspace | None
    num_prefills: int
    max_q_len: int


@dataclass
class _StaticWorkspace:
    """Decode buffers that outlive a step, so that CUDA graphs can bake in their addresses."""

    max_bs: int
    num_splits: torch.Tensor  # [max_bs] int32
    mid: torch.Tensor  # flat float32, big enough for every batch size up to max_bs


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton (see the module docstring and the base-class contract).

    Args:
        num_heads, num_kv_heads, head_dim, scale, sliding_window, layers: as `AttentionBackend`.
        config: kernel settings; defaults suit Hopper GPUs.

    Each layer's window or chunk, sinks and softcapping are constexpr or arguments of the same two kernel
    families (one compiled variant per distinct layer type). The decode split counts are computed once per step
    for the widest layer type (a windowed layer's extra splits are empty).
    """

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, config: TritonAttentionConfig | None = None,
                 layers=None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, layers)
        kinds = self.specs
        # split counts need only cover the widest layer: one shared window, else the whole context
        self._split_window = kinds[0].window if len(kinds) == 1 and kinds[0].kind == "sliding" else None
        self.config = config or TritonAttentionConfig()
        self._num_sms: int | None = self.config.num_sms
        self._static: _StaticWorkspace | None = None
        self._plan: _StepPlan | None = None

    # ---- per step ----------------------------------------------------------
    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Plan the step: decode split counts (on the device) and the prefill grid (from host lengths)."""
        nd, nr = batch.num_decodes, batch.num_reqs
        decode_ws = self._decode_workspace(batch.seq_lens[:nd], nd) if nd else None
        max_q_len = max(batch.query_lens_cpu[nd:nr], default=0)
        self._plan = _StepPlan(batch, decode_ws, nr - nd, max_q_len)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = pool.layer_cache(layer)
        k_scale, v_scale = pool.layer_scales(layer)
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale, self.config.store_num_warps)
        return self.attend(layer, q, pool, batch, sinks)

    def attend(self, layer: int, q: torch.Tensor, pool: KVPool, batch: ForwardBatch,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention only, over what the pool holds (the step's K/V must already be stored).

        Args:
            q: [T, num_heads, head_dim] float16/bfloat16/float32, last dim contiguous.
            sinks: [num_heads] sink logits, used when the layer's spec has sinks.

        Returns:
            [T, num_heads * head_dim] in q's dtype.
        """
        if self._plan is None or self._plan.batch is not batch:
            self.prepare(batch, pool)
        plan = self._plan
        k_cache, v_cache = pool.layer_cache(layer)
        k_scale, v_scale = pool.layer_scales(layer)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = batch.num_decodes
        spec = self.spec(layer)
        mask = dict(sliding_window=spec.window, chunk_size=spec.chunk_size,
                    sinks=sinks if spec.sinks else None, softcap=spec.logit_softcap)
        if plan.decode_ws is not None:
            decode_attention(q[:nd], k_cache, v_cache, batch.block_tables[:nd], batch.seq_lens[:nd], out[:nd],
                             plan.decode_ws, self.scale, k_scale, v_scale, self.config.decode, **mask)
        if plan.num_prefills:
            extend_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, out,
                             nd, plan.num_prefills, plan.max_q_len, self.scale, k_scale, v_scale,
                             self.config.extend, **mask)
        return out.view(q.shape[0], -1)

    # ---- CUDA graphs ---------------------------------------------------------
    def prepare_for_capture(self, max_bs: int, device: torch.device) -> None:
        """Allocate static decode buffers for batches up to `max_bs` (before any capture).

        Later decode steps of up to `max_bs` requests use these buffers, so a
        captured graph and an eager step see the same addresses.
        """
        self._num_sms_for(device)
        floats = max(self._mid_floats(bs) for bs in range(1, max_bs + 1))
        self._static = _StaticWorkspace(
            max_bs,
            torch.ones(max_bs, dtype=torch.int32, device=device),
            torch.zeros(floats, dtype=torch.float32, device=device),
        )

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """Nothing to do: the split counts are computed inside the graph, from the static `seq_lens`."""

    # ---- helpers ---------------------------------------------------------------
    def _num_sms_for(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = DEFAULT_NUM_SMS_OFF_GPU
        return self._num_sms

    def _max_splits(self, bs: int) -> int:
        return max_splits_for(bs, self.num_kv_heads, self._num_sms, self.config.decode)

    def _mid_floats(self, bs: int) -> int:
        return bs * self.num_heads * self._max_splits(bs) * (self.head_dim + 1)

    def _decode_workspace(self, seq_lens: torch.Tensor, nd: int) -> DecodeWorkspace:
        self._num_sms_for(seq_lens.device)
        s = self._max_splits(nd)
        h, d = self.num_heads, self.head_dim
        static = self._static
        if static is not None and nd <= static.max_bs and static.mid.device == seq_lens.device:
            splits = num_kv_splits(seq_lens, s, self.config.decode, self._split_window, out=static.num_splits[:nd])
            mid = static.mid[: nd * h * s * (d + 1)]
        else:
            splits = num_kv_splits(seq_lens, s, self.config.decode, self._split_window)
            mid = torch.empty(nd * h * s * (d + 1), dtype=torch.float32, device=seq_lens.device)
        mid_o = mid[: nd * h * s * d].view(nd, h, s, d)
        mid_lse = mid[nd * h * s * d:].view(nd, h, s)
        return DecodeWorkspace(splits, mid_o, mid_lse, s)
