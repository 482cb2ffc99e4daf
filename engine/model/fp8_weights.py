"""Block-quantised FP8 checkpoint weights (DeepSeek-V3's release format), dequantised on load.

A checkpoint whose ``config.json`` says ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` stores each linear weight ``W`` [N, K] as
``float8_e4m3fn`` beside ``W_scale_inv`` [ceil(N / 128), ceil(K / 128)] float32, and the true weight is
``W[i, j] * W_scale_inv[i // 128, j // 128]`` (DeepSeek-V3's ``inference/fp8_cast_bf16.py`` ``weight_dequant``;
transformers' ``FineGrainedFP8`` with ``dequantize=True``). The engine has no FP8 GEMM, so the loader
dequantises every such weight into the model's dtype (bf16 for DeepSeek-V3: the weights take twice the FP8
bytes, as `pd-plan` counts them) and runs it like any other; the activations are not quantised, which is the
same math as the FP8 GEMM up to its per-token activation rounding. Embeddings, norms, the router and the LM head
are not quantised in that format and load as they are.

`block_fp8_slice` wraps such a tensor so that the loader's sharding code (``get_shape`` / slicing) sees the
dequantised values; under TP each rank dequantises the whole tensor and keeps its slice.
"""

from __future__ import annotations

import torch

FP8_DTYPE_NAMES = ("F8_E4M3",)  # safetensors' dtype name of float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight * scale_inv`` broadcast over `block`-sized tiles.

    Args:
        weight: [N, K] float8_e4m3fn.
        scale_inv: [ceil(N / block[0]), ceil(K / block[1])] float32 (any float dtype is read as float32).
        block: (rows, columns) of one quantisation block, ``weight_block_size``.

    Returns:
        [N, K] float32.

    Raises:
        ValueError: `scale_inv`'s shape does not tile `weight` in `block`s.
    """
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not tile a {n}x{k} weight in "
                         f"{bn}x{bk} blocks (expected {want})")
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * scale


class DequantizedSlice:
    """Stands in for a safetensors slice of an FP8 weight: the same shape, slicing returns dequantised float32
    values. The tensor is read and dequantised on first use, so a slice that is never indexed (another
    expert-parallel rank's expert) costs nothing."""

    def __init__(self, weight_slice, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        self._slice, self._scale_inv, self._block = weight_slice, scale_inv, block
        self._values: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return list(self._slice.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        if self._values is None:
            self._values = dequantize_block_fp8(self._slice[:], self._scale_inv, self._block)
        return self._values[index]


def block_fp8_slice(name: str, tensor_slice, scale_of, block: tuple[int, int] | None):
    """`tensor_slice` of checkpoint tensor `name`, dequantised when it is FP8.

    Args:
        name: the checkpoint name, e.g. ``model.layers.0.mlp.down_proj.weight``.
        tensor_slice: its safetensors slice.
        scale_of: ``scale_of(name)`` returns the tensor ``name`` from the checkpoint, or None when absent.
        block: the config's ``weight_block_size``, None when the config declares no block-FP8 weights.

    Raises:
        ValueError: an FP8 tensor without ``<name>_scale_inv``, or in a checkpoint whose config declares no
            block quantisation: its values alone are not the weights, so it is never loaded as they are.
    """
    if tensor_slice.get_dtype() not in FP8_DTYPE_NAMES:
        return tensor_slice
    scale_inv = scale_of(name + SCALE_SUFFIX)
    if block is None or scale_inv is None:
        raise ValueError(f"{name} is stored in FP8 but the checkpoint has no block scale for it "
                         f"({name}{SCALE_SUFFIX}, with quantization_config.weight_block_size); refusing to load "
                         "FP8 values as weights")
    return DequantizedSlice(tensor_slice, scale_inv, block)
