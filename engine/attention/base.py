"""The attention backend interface.

A backend writes a step's K and V into the paged pool and computes attention
of the step's queries over each request's whole context, read back from the
pool. Reading the current chunk back from the pool too (rather than using the
fresh full-precision K/V) means chunked and unchunked prefill, and prefill on
another worker followed by a KV transfer, see exactly the same KV values.

Backends are chosen by name through `pd_cluster.engine.attention.get_backend`; the torch
reference backend runs everywhere, the Triton backend on GPUs (and under
``TRITON_INTERPRET=1`` for tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool


class AttentionBackend(ABC):
    """Paged attention over a `KVPool` (contract for every backend).

    Args:
        num_heads: query heads of this TP rank.
        num_kv_heads: KV heads of this TP rank (divides `num_heads`: GQA).
        head_dim: size of one head.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: attend only to the last `sliding_window` positions, or None.
    """

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Per-step set-up shared by all layers (index tensors, split counts).

        Called once before the layers run. The default does nothing.
        """

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch) -> torch.Tensor:
        """Store `k`, `v` at ``batch.slot_mapping`` and attend.

        Args:
            layer: layer index into the pool.
            q: [T, num_heads, head_dim] queries (RoPE applied).
            k, v: [T, num_kv_heads, head_dim] the step's keys and values.

        Returns:
            [T, num_heads * head_dim] attention output, in q's dtype. Rows of
            padded tokens (slot -1) are unspecified.
        """
