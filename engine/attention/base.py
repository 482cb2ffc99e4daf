"""The attention backend interface.

A backend writes a step's K and V into the paged pool and computes attention
of the step's queries over each request's whole context, read back from the
pool. Reading the current chunk back from the pool too (rather than using the
fresh full-precision K/V) means chunked and unchunked prefill, and prefill on
another worker followed by a KV transfer, see exactly the same KV values.

Each layer attends as its `LayerAttention` says (`pd_cluster.engine.layer_attention`): over the whole
context, a sliding window or its own chunk; with attention sinks; with soft-capped logits. A backend holds
one per layer (`AttentionBackend.layers`). Every path starts reading at a query's first visible key, so pages
behind a window may have been freed (KV cache groups, `pd_cluster.engine.kv.groups`): the model hands each layer
the batch of its group (`ForwardBatch.for_group`), whose block tables and slot mapping are that group's.

Backends are chosen by name through `pd_cluster.engine.attention.get_backend`; the torch
reference backend runs everywhere, the Triton backend on GPUs (and under
``TRITON_INTERPRET=1`` for tests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.layer_attention import LayerAttention

FULL = LayerAttention()


class AttentionBackend(ABC):
    """Paged attention over a `KVPool` (contract for every backend).

    Args:
        num_heads: query heads of this TP rank.
        num_kv_heads: KV heads of this TP rank (divides `num_heads`: GQA).
        head_dim: size of one head.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: every layer attends only to the last `sliding_window` positions (None: full), when
            `layers` is None.
        layers: each layer's attention type (`ArchConfig.layer_attention`); overrides `sliding_window`.

    Raises:
        ValueError: heads that do not group, or a window below 1.
    """

    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, layers: tuple[LayerAttention, ...] | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.layers = tuple(layers) if layers else None
        self._uniform = (LayerAttention("sliding", window=sliding_window) if sliding_window is not None else FULL)

    def spec(self, layer: int) -> LayerAttention:
        """Layer `layer`'s attention type."""
        return self.layers[layer] if self.layers is not None else self._uniform

    @property
    def specs(self) -> tuple[LayerAttention, ...]:
        """The distinct attention types of the layers (one when every layer is alike)."""
        return tuple(dict.fromkeys(self.layers)) if self.layers is not None else (self._uniform,)

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Per-step set-up shared by all layers (index tensors, split counts).

        Called once before the layers run. The default does nothing.
        """

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store `k`, `v` at ``batch.slot_mapping`` and attend as layer `layer`'s `spec` says.

        Args:
            layer: layer index into the pool.
            q: [T, num_heads, head_dim] queries (RoPE applied).
            k, v: [T, num_kv_heads, head_dim] the step's keys and values.
            sinks: [num_heads] learned sink logits (gpt-oss), for layers whose spec has ``sinks``: each
                head's softmax denominator gains ``exp(sink)`` (no value attached), or None.

        Returns:
            [T, num_heads * head_dim] attention output, in q's dtype. Rows of
            padded tokens (slot -1) are unspecified.
        """
