"""The paged KV pool: one tensor that holds every layer's K and V pages (or MLA latents).

Layout (page-major, heads-then-tokens inside a page)::

    kv[num_pages + 1, num_layers, 2, num_kv_heads, page_size, head_dim]      # kv_format "mha"
    kv[num_pages + 1, num_layers, 1, 1, page_size, latent_dim]               # kv_format "mla"

Index 0 of the first axis is the null page (see `allocator.NULL_PAGE`); index
2 is K (0) or V (1). Multi-head latent attention (DeepSeek-V2/V3) caches one
latent per token per layer instead (``kv_lora_rank + qk_rope_head_dim`` values,
576 for DeepSeek-V3; vLLM's and SGLang's MLA pools), written by `store_latent`
and read by `gather_latent` / `latent_cache`: the same page-major tensor with
one plane and one "head". A page therefore holds all layers of `page_size` tokens in
one contiguous block of `page_nbytes` bytes: the whole pool is one region to
register with NIXL, and one request's KV is one descriptor per run of
consecutive pages. Inside a page, one KV head's `page_size x head_dim` tile is
contiguous, which is what the attention kernels load.

The pool owns quantisation (`store_kv`) and dequantisation (`gather`): for
``fp8_e4m3`` the storage is uint8 holding float8_e4m3fn bits, with one float32
scale per layer for K and one for V (``x_fp8 = clamp(x / scale, -448, 448)``,
clamped before the cast because PyTorch's cast does not saturate); an MLA latent
uses the layer's K scale (vLLM's rule; its V scale stays 1.0). Callers never
see uint8 views or scales unless they ask for them (`layer_cache`, `scales`).

With KV cache groups (`pd_cluster.engine.kv.groups`, hybrid models) the second axis holds
``layout.layers_per_page`` slots and a page belongs to one group: layer ``l`` lives in slot
``groups.slot_of_layer[l]`` of its group's pages. Methods still take the model's layer index.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property

import torch

from pd_cluster.engine.kv.groups import KVGroups, single_group

FP8_E4M3_MAX = 448.0

_STORAGE = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.uint8,
}
_ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}
KV_FORMATS = ("mha", "mla")  # K and V per KV head; one latent per token (multi-head latent attention)


@dataclass(frozen=True)
class KVLayout:
    """What two pools must agree on to exchange pages byte for byte.

    Attributes:
        num_layers, num_kv_heads (per TP rank), head_dim, page_size: the shape.
        kv_cache_dtype: ``bf16``, ``fp16``, ``fp32`` or ``fp8_e4m3``.
        k_scales, v_scales: per-layer FP8 scales (1.0 when not FP8; an MLA latent uses `k_scales`).
        tp_size, tp_rank: which slice of the KV heads this pool holds (MLA: every rank holds the same latent).
        kv_format: ``mha`` (K and V per KV head) or ``mla`` (one latent per token: ``num_kv_heads`` 1,
            ``head_dim`` the latent's width, one plane instead of K and V).
        page_nbytes: bytes of one page (all layers, K and V).
        layers_per_page: layer slots of one page when the layers form KV cache groups
            (`pd_cluster.engine.kv.groups`: a page then holds one group's layers); 0: every layer (one group).
        kv_groups: the groups, one ``"<rule>:<layers>"`` string each in pool order (`KVGroups.signature`), so
            two pools that exchange pages agree on which layers a page holds; empty for one group.

    Raises:
        ValueError: an unknown `kv_format`, or ``mla`` with more than one KV head.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_cache_dtype: str
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]
    tp_size: int = 1
    tp_rank: int = 0
    order: str = "page,layer,kv,head,token,dim"
    kv_format: str = "mha"
    layers_per_page: int = 0
    kv_groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.kv_format == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"an MLA pool holds one latent per token (num_kv_heads 1), got {self.num_kv_heads}")

    @property
    def page_layers(self) -> int:
        """Layer slots of one page: `layers_per_page`, or every layer."""
        return self.layers_per_page or self.num_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_format == "mla"

    @property
    def num_planes(self) -> int:
        """2 (K and V) for ``mha``, 1 (the latent) for ``mla``."""
        return 1 if self.is_mla else 2

    @property
    def element_size(self) -> int:
        return _ELEMENT_SIZE[self.kv_cache_dtype]

    @cached_property
    def page_nbytes(self) -> int:
        return (self.page_layers * self.num_planes * self.num_kv_heads * self.page_size * self.head_dim
                * self.element_size)

    @property
    def bytes_per_token(self) -> int:
        return self.page_nbytes // self.page_size

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.layers_per_page:
            del d["layers_per_page"]  # one group: the layout (and its hash) of a pool without groups
        if not self.kv_groups:
            del d["kv_groups"]
        else:
            d["kv_groups"] = list(self.kv_groups)
        d["page_nbytes"] = self.page_nbytes
        return d

    def hash(self) -> str:
        """A short stable hash of the layout, for `/server_info` and logs."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class KVPool:
    """Paged K/V storage for all layers of one TP rank.

    Args:
        layout: shape, dtype and scales of the pool.
        num_pages: usable pages (the null page comes on top).
        device: where the pool lives (``cpu`` or ``cuda:N``).
        compute_dtype: dtype `gather` returns (the model's activation dtype).

    The tensor is zero-filled at creation so its memory is really committed.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str,
                 compute_dtype: torch.dtype, groups: KVGroups | None = None) -> None:
        if groups is not None and (groups.layers_per_page != layout.page_layers
                                   or groups.num_layers != layout.num_layers):
            raise ValueError(f"KV groups of {groups.num_layers} layers, {groups.layers_per_page} a page, do not "
                             f"match the layout's {layout.num_layers} layers, {layout.page_layers} a page")
        self.layout = layout
        self.groups = groups if groups is not None else single_group(layout.num_layers)
        self._slot = self.groups.slot_of_layer
        self._group = self.groups.group_of_layer
        self.num_pages = num_pages
        self.page_size = layout.page_size
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.is_fp8 = layout.kv_cache_dtype == "fp8_e4m3"
        shape = (num_pages + 1, layout.page_layers, layout.num_planes, layout.num_kv_heads, layout.page_size,
                 layout.head_dim)
        self.kv = torch.zeros(shape, dtype=_STORAGE[layout.kv_cache_dtype], device=self.device)
        self.scales = torch.tensor([layout.k_scales, layout.v_scales], dtype=torch.float32,
                                   device=self.device).t().contiguous()  # [num_layers, 2]
        self._k_scale = [float(s) for s in layout.k_scales]
        self._v_scale = [float(s) for s in layout.v_scales]
        # The pool as rows of head_dim elements, for index_copy_ writes (see store_kv).
        self._rows_view = self.kv.view(-1, layout.head_dim)
        self._kv_rows = layout.num_kv_heads * layout.page_size      # K -> V of one layer
        self._layer_rows = layout.num_planes * self._kv_rows        # one layer -> the next
        self._rows_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- sizes -------------------------------------------------------------
    @property
    def max_total_num_tokens(self) -> int:
        """Capacity in tokens (SGLang's ``max_total_num_tokens``)."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.scales.numel() * 4

    def regions(self) -> list[torch.Tensor]:
        """The tensors to register for RDMA: the page tensor and the scales."""
        return [self.kv, self.scales]

    # ---- write -------------------------------------------------------------
    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write one layer's K and V of a step into their slots.

        Args:
            k, v: [num_tokens, num_kv_heads, head_dim], any float dtype.
            slot_mapping: [num_tokens] int64, ``page * page_size + offset``;
                -1 marks a padded token whose write is discarded (it lands in the
                null page, which is never read unmasked).

        Raises:
            ValueError: an MLA pool (use `store_latent`).
        """
        if self.layout.is_mla:
            raise ValueError("an MLA pool stores latents (store_latent), not K and V")
        rows = self._rows_for(slot_mapping) + self._slot[layer] * self._layer_rows
        d = self.layout.head_dim
        self._rows_view.index_copy_(0, rows.reshape(-1), self._quantize(k, self._k_scale[layer]).reshape(-1, d))
        self._rows_view.index_copy_(0, (rows + self._kv_rows).reshape(-1),
                                    self._quantize(v, self._v_scale[layer]).reshape(-1, d))

    def _rows_for(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """[T, num_kv_heads] row indices (rows of head_dim elements) of layer 0's K for a step's slots.

        Computed once per step: every layer passes the same slot_mapping tensor.
        """
        if self._rows_cache is not None and self._rows_cache[0] is slot_mapping:
            return self._rows_cache[1]
        slots = slot_mapping.clamp(min=0)
        lay = self.layout
        pages, offsets = slots // lay.page_size, slots % lay.page_size
        heads = torch.arange(lay.num_kv_heads, device=slots.device) * lay.page_size
        page_rows = lay.page_layers * lay.num_planes * lay.num_kv_heads * lay.page_size
        rows = (pages * page_rows + offsets)[:, None] + heads[None, :]
        self._rows_cache = (slot_mapping, rows)
        return rows

    def store_latent(self, layer: int, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write one layer's MLA latents of a step into their slots (FP8: the layer's K scale).

        Args:
            latent: [num_tokens, latent_dim] (``c`` then ``k_pe``), any float dtype.
            slot_mapping: as `store_kv` (-1: padding, discarded).

        Raises:
            ValueError: not an MLA pool.
        """
        if not self.layout.is_mla:
            raise ValueError("store_latent needs an MLA pool (kv_format 'mla')")
        rows = self._rows_for(slot_mapping)[:, 0] + self._slot[layer] * self._layer_rows
        self._rows_view.index_copy_(0, rows, self._quantize(latent, self._k_scale[layer]))

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.is_fp8:
            return x.to(self.kv.dtype)
        x = x.float()
        if scale != 1.0:
            x = x / scale
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    # ---- read --------------------------------------------------------------
    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised K and V of whole pages, for the reference attention.

        Args:
            block_tables: [batch, num_pages_per_seq] int page ids (pad with 0).

        Returns:
            k, v: [batch, num_kv_heads, num_pages_per_seq * page_size, head_dim]
            in `compute_dtype`.
        """
        pages = self.kv[block_tables.long(), self._slot[layer]]  # [B, n, 2, H, ps, D]
        b, n, _, h, ps, d = pages.shape
        pages = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, b, h, n * ps, d)
        return self._dequantize(pages[0], self._k_scale[layer]), self._dequantize(pages[1], self._v_scale[layer])

    def gather_latent(self, layer: int, block_tables: torch.Tensor) -> torch.Tensor:
        """Dequantised MLA latents of whole pages, for the reference attention.

        Args:
            block_tables: [batch, num_pages_per_seq] int page ids (pad with 0).

        Returns:
            [batch, num_pages_per_seq * page_size, latent_dim] in `compute_dtype`.
        """
        pages = self.kv[block_tables.long(), self._slot[layer], 0, 0]  # [B, n, ps, D]
        b, n, ps, d = pages.shape
        return self._dequantize(pages.reshape(b, n * ps, d), self._k_scale[layer])

    def _dequantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.is_fp8:
            return x.to(self.compute_dtype)
        x = x.view(torch.float8_e4m3fn).to(self.compute_dtype)
        return x * scale if scale != 1.0 else x

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw views for kernels: K and V of `layer`, [num_pages + 1, num_kv_heads, page_size, head_dim],
        in the storage dtype (float8_e4m3fn for FP8), strided over the page axis."""
        slot = self._slot[layer]
        k, v = self.kv[:, slot, 0], self.kv[:, slot, 1]
        if self.is_fp8:
            k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
        return k, v

    def latent_cache(self, layer: int) -> torch.Tensor:
        """Raw view for kernels of an MLA pool: the latents of `layer`, [num_pages + 1, page_size, latent_dim],
        in the storage dtype (float8_e4m3fn for FP8), strided over the page axis."""
        c = self.kv[:, self._slot[layer], 0, 0]
        return c.view(torch.float8_e4m3fn) if self.is_fp8 else c

    def group_of(self, layer: int) -> int:
        """The KV group of `layer` (0 without groups): its block tables and slots are that group's."""
        return self._group[layer]

    def read_states(self, block_tables: torch.Tensor, num_floats: int) -> torch.Tensor:
        """A copy of each request's recurrent state, [B, num_floats] float32: the bytes of its state group's
        pages (`block_tables` [B, n] int32 of the state group, `KVGroups.state_group`), in table order.
        Those pages hold raw float32 whatever the KV dtype (never quantised)."""
        b = block_tables.shape[0]
        raw = self.kv.view(-1).view(torch.uint8).view(self.kv.shape[0], -1)[block_tables.long()]  # [B, n, bytes]
        return raw.reshape(b, -1)[:, :num_floats * 4].clone().view(torch.float32)

    def write_states(self, block_tables: torch.Tensor, states: torch.Tensor) -> None:
        """Store `states` [B, floats] float32 into each request's state pages (`read_states`' inverse)."""
        b, n = block_tables.shape
        pages = self.kv.view(-1).view(torch.uint8).view(self.kv.shape[0], -1)
        raw = torch.zeros(b, n * pages.shape[1], dtype=torch.uint8, device=self.device)
        raw[:, :states.shape[1] * 4] = states.contiguous().view(torch.uint8)
        pages[block_tables.long()] = raw.view(b, n, -1)

    def layer_slot(self, layer: int) -> int:
        """Index of `layer` on the pool's second axis (its slot within its KV group's pages; `layer` itself
        without groups)."""
        return self._slot[layer]

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """The FP8 (k_scale, v_scale) of `layer`; (1.0, 1.0) for other dtypes."""
        if not self.is_fp8:
            return 1.0, 1.0
        return self._k_scale[layer], self._v_scale[layer]

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of the raw bytes of `pages` ([len(pages), *page shape]); for checks and tests."""
        return self.kv[torch.tensor(pages, dtype=torch.long, device=self.device)].clone()
