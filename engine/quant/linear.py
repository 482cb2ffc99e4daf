"""`QuantLinear`: a linear layer whose weight stays quantised in memory (FP8 or int4), computed a block at a time
on the CPU and by the quantised GEMM kernels on the GPU.

Memory (`QuantLinear` buffers; N output rows, K input columns of this rank):

* FP8: ``weight`` [N, K] float8_e4m3fn; ``weight_scale`` float32, [ceil(N / bn), ceil(K / bk)] for blocks or [N]
  for a scale per row (per channel; a per-tensor scale is repeated on its rows, so fused q/k/v parts keep their
  own exactly); ``input_scale`` [] float32 for static activation scales (the largest of the fused parts', as vLLM
  takes it).
* int4: ``qweight`` [ceil(K / 8), N] int32, ``scales`` [G, N] in the checkpoint's dtype (float32 while
  loading; `QuantLinear.finish_loading` returns them to the parts' common fp16/bf16), ``zeros`` [G, N] uint8 or None (8), ``g_idx`` [K] int32 or None (`pd_cluster.engine.quant.int4`).
* ``bias`` [N] in the model dtype, or None.

Compute, and how it compares with a checkpoint's dequantised twin (the same weights stored as their exact
dequantised values in the model dtype):

* Reference path (CPU, and any device without the kernels): weight-only. Each tile of output rows (at most
  `TILE_BYTES` of dequantised weight) is dequantised in float32, rounded once to the activation dtype, and
  multiplied by the unquantised activations with ``F.linear``. When one tile covers the layer (every layer of the
  tests' tiny models) this is the twin's own ``F.linear`` on the same values, so outputs are bit-identical.
* Kernel path (CUDA): FP8 is W8A8 as vLLM and SGLang compute it: the activations are quantised to FP8 (per token
  and block column for blocks, per token otherwise, or the static ``input_scale``) and multiplied in FP8 with
  float32 accumulation, by the Triton block kernel or ``torch._scaled_mm`` (rowwise scales, Hopper); W8A16 and
  int4 W4A16 dequantise inside the Triton kernels. The kernels are tested against `pd_cluster.engine.quant.fp8`'s
  W8A8 reference and this module's reference path under Triton's interpreter, within tolerance: W8A8 rounds the
  activations, so it is not exact against the twin (as in every engine that serves these checkpoints).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pd_cluster.engine.quant.fp8 import FP8_DTYPE, dequantize_fp8
from pd_cluster.engine.quant.int4 import dequantize_int4
from pd_cluster.engine.quant.weight_scheme import FP8, INT4, WeightScheme

TILE_BYTES = 64 * 2**20  # the reference path dequantises at most this many float32 weight bytes at a time


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with W kept quantised (module docstring).

    Args:
        in_features, out_features: this rank's K and N.
        bias: whether the layer has a bias.
        scheme: how the checkpoint stores the weight (``kind`` fp8 or int4).
        name: the checkpoint module name, for errors.
        dtype: the model's dtype (the bias's, and the reference path's compute dtype follows the input).

    `forward(x [..., K]) -> [..., N]` in x's dtype. Fill with `load_part` before use.

    Raises:
        ValueError: a kind other than fp8 or int4.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: WeightScheme, name: str,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if scheme.kind not in (FP8, INT4):
            raise ValueError(f"{name}: {scheme.kind} weights are not computed by a dense linear layer")
        self.in_features, self.out_features, self.scheme, self.name = in_features, out_features, scheme, name
        self.use_kernels = False  # set by `set_kernels`: the quantised GEMM kernels instead of the reference
        n, k = out_features, in_features
        if scheme.kind == FP8:
            self.register_buffer("weight", torch.empty(n, k, dtype=FP8_DTYPE))
            shape = (-(-n // scheme.block[0]), -(-k // scheme.block[1])) if scheme.block else (n,)
            self.register_buffer("weight_scale", torch.empty(shape, dtype=torch.float32))
            self.register_buffer("input_scale", torch.zeros((), dtype=torch.float32)
                                 if scheme.activations == "static" else None)
        else:
            groups = -(-k // scheme.group_size) if scheme.group_size else 1
            self.register_buffer("qweight", torch.empty(-(-k // 8), n, dtype=torch.int32))
            self.register_buffer("scales", torch.empty(groups, n, dtype=torch.float32))
            self.register_buffer("zeros", None)
            self.register_buffer("g_idx", None)
        self._scale_dtypes: set[torch.dtype] = set()
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype)) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"

    def load_part(self, rows: tuple[int, int], tensors: dict[str, torch.Tensor | None]) -> None:
        """Copy one part's quantised tensors (a fused module's q, k or v; or the whole weight) into output rows
        ``[rows[0], rows[1])``.

        Args:
            rows: the part's output rows in this module (this rank's).
            tensors: fp8: ``weight`` [n, K] float8_e4m3fn, ``scale`` ([ceil(n / bn), ceil(K / bk)] or [n]),
                ``input_scale`` (scalar or None); int4: ``qweight`` [ceil(K / 8), n] int32, ``scales`` [G, n],
                ``zeros`` [G, n] uint8 or None, ``g_idx`` [K] or None.

        Raises:
            ValueError: shapes that do not fit, a part that splits a block, or fused parts with different
                ``g_idx`` (each names the module).
        """
        r0, r1 = rows
        if self.scheme.kind == FP8:
            self._load_fp8(r0, r1, tensors)
        else:
            self._load_int4(r0, r1, tensors)

    def _check(self, what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if got != want:
            raise ValueError(f"{self.name}: {what} of shape {got}, expected {want}")

    def _load_fp8(self, r0: int, r1: int, t: dict[str, torch.Tensor | None]) -> None:
        w, scale = t["weight"], t["scale"]
        self._check("weight", tuple(w.shape), (r1 - r0, self.in_features))
        self.weight[r0:r1].copy_(w)
        block = self.scheme.block
        if block is None:
            self.weight_scale[r0:r1].copy_(scale.reshape(-1).float().expand(r1 - r0)
                                           if scale.numel() == 1 else scale.reshape(-1).float())
        else:
            bn = block[0]
            if r0 % bn or (r1 % bn and r1 != self.out_features):
                raise ValueError(f"{self.name}: a fused part at rows [{r0}, {r1}) splits its {bn}x{block[1]} FP8 "
                                 f"blocks; each part must be a multiple of {bn} rows")
            self._check("weight scale", tuple(scale.shape), (-(-(r1 - r0) // bn), self.weight_scale.shape[1]))
            self.weight_scale[r0 // bn:r0 // bn + scale.shape[0]].copy_(scale.float())
        if self.input_scale is not None:
            static = t.get("input_scale")
            if static is None:
                raise ValueError(f"{self.name}: static activation scales but no input_scale in the checkpoint")
            self.input_scale.copy_(torch.maximum(self.input_scale, static.float().reshape(())))

    def _load_int4(self, r0: int, r1: int, t: dict[str, torch.Tensor | None]) -> None:
        q, scales, zeros, g_idx = t["qweight"], t["scales"], t.get("zeros"), t.get("g_idx")
        first = not self._scale_dtypes  # no part loaded yet
        if g_idx is not None and first and scales.shape[0] != self.scales.shape[0]:
            # act order under a split of the input columns: every rank keeps all of the groups' scales
            self.scales = torch.empty(scales.shape[0], self.out_features, device=self.qweight.device)
        self._check("qweight", tuple(q.shape), (self.qweight.shape[0], r1 - r0))
        self._check("scales", tuple(scales.shape), (self.scales.shape[0], r1 - r0))
        self.qweight[:, r0:r1].copy_(q)
        self.scales[:, r0:r1].copy_(scales.float())
        self._scale_dtypes.add(scales.dtype)
        if zeros is not None:
            if self.zeros is None:
                self.zeros = torch.full(tuple(self.scales.shape), 8, dtype=torch.uint8, device=self.scales.device)
            self.zeros[:, r0:r1].copy_(zeros)
        if g_idx is not None or self.g_idx is not None:
            if self.g_idx is None and first:
                self._check("g_idx", tuple(g_idx.shape), (self.in_features,))
                self.g_idx = g_idx.to(device=self.qweight.device, dtype=torch.int32).contiguous()
            elif g_idx is None or self.g_idx is None or not torch.equal(self.g_idx.cpu(), g_idx.to(torch.int32).cpu()):
                raise ValueError(f"{self.name}: its fused parts have different g_idx (act-order permutations); the "
                                 "engine fuses parts that share their input's group order")

    def finish_loading(self) -> None:
        """After every part is in: int4 scales go back to the checkpoint's 16-bit dtype when all parts share one
        (exactly: they were read from it), so the layer holds the checkpoint's bytes."""
        if self.scheme.kind == INT4 and len(self._scale_dtypes) == 1:
            dtype = next(iter(self._scale_dtypes))
            if dtype in (torch.float16, torch.bfloat16):
                self.scales = self.scales.to(dtype)

    def dequantized(self, rows: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Output rows ``[r0, r1)`` (default all) as an nn.Linear weight [r1 - r0, K] in `dtype` (float32 math).
        For the reference path, and for layers whose weight the model uses as a matrix (MLA's ``kv_b_proj``)."""
        r0, r1 = rows or (0, self.out_features)
        if self.scheme.kind == FP8:
            block = self.scheme.block
            if block is None:
                return dequantize_fp8(self.weight[r0:r1], self.weight_scale[r0:r1], None, dtype)
            bn = block[0]  # tiles start on a block boundary (`_tile_rows`)
            scale = self.weight_scale[r0 // bn:-(-r1 // bn)]
            return dequantize_fp8(self.weight[r0:r1], scale, block, dtype)
        zeros = self.zeros[:, r0:r1] if self.zeros is not None else None
        return dequantize_int4(self.qweight[:, r0:r1], self.scales[:, r0:r1], zeros, self.g_idx,
                               self.scheme.group_size, self.in_features, dtype)

    def _tile_rows(self) -> int:
        rows = max(1, TILE_BYTES // (4 * self.in_features))
        align = self.scheme.block[0] if self.scheme.block else 1
        return max(align, rows // align * align)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype; `add_bias` False leaves the bias out (added after an all-reduce)."""
        if self.use_kernels:
            from pd_cluster.engine.quant.kernels import quant_linear

            return quant_linear(self, x, add_bias)
        return self.reference(x, add_bias)

    def reference(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """The weight-only reference path (module docstring): output tiles of dequantised rows."""
        n, step = self.out_features, self._tile_rows()
        bias_all = self.bias if add_bias else None
        if step >= n:
            return F.linear(x, self.dequantized(dtype=x.dtype), bias_all)
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            bias = bias_all[r0:r1] if bias_all is not None else None
            out[..., r0:r1] = F.linear(x, self.dequantized((r0, r1), x.dtype), bias)
        return out

    def set_kernels(self, enabled: bool) -> None:
        """Compute through the quantised GEMM kernels (`pd_cluster.engine.quant.kernels`) or the reference."""
        self.use_kernels = enabled

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds (its buffers and bias)."""
        return sum(t.numel() * t.element_size() for t in (*self.buffers(), *self.parameters()))
