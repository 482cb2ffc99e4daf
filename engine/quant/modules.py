"""Model construction with quantised linear layers: linear layers are built as shapes first and become
`QuantLinear` or ``nn.Linear`` once the loader knows how the checkpoint stores each, so no layer ever allocates
its full-precision weight when the checkpoint holds it quantised.

* `make_linear` is what the model classes call for every linear layer: ``nn.Linear`` normally (a model built on
  its own, in a test or a benchmark), a `DeferredLinear` (shape only) inside `deferred_linears`, which the loader
  opens around the model's construction.
* `materialize` then replaces each `DeferredLinear`: a `QuantLinear` of its scheme where the checkpoint's tensors
  are quantised, else an ``nn.Linear`` whose weight is allocated uninitialised (it is loaded next; a weight tied
  before, like a tied LM head's, is kept).
* `linear_no_bias` applies a layer's weight without its bias (the o_proj bias added once after the TP all-reduce).
* `DequantizedSlice` stands in for a quantised checkpoint tensor where the engine holds dequantised values
  (routed experts whose kind the MoE kernel does not keep: `pd_cluster.engine.quant.support`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn import functional as F

from pd_cluster.engine.quant.linear import QuantLinear
from pd_cluster.engine.quant.loading import Reader, read_module
from pd_cluster.engine.quant.weight_scheme import WeightScheme

_DEFERRED: ContextVar[bool] = ContextVar("deferred_linears", default=False)


class DeferredLinear(nn.Module):
    """A linear layer's shape (``in_features``, ``out_features``, ``has_bias``) until `materialize`."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a DeferredLinear runs only after the loader has materialised it")


def make_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Module:
    """``nn.Linear(in_features, out_features, bias)``, or a `DeferredLinear` inside `deferred_linears`."""
    if _DEFERRED.get():
        return DeferredLinear(in_features, out_features, bias)
    return nn.Linear(in_features, out_features, bias=bias)


@contextmanager
def deferred_linears() -> Iterator[None]:
    """Within: `make_linear` gives `DeferredLinear` s (this thread's context only)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def materialize(model: nn.Module, quantized: dict[str, WeightScheme], device: torch.device, dtype: torch.dtype
                ) -> list[str]:
    """Replace every `DeferredLinear` of `model`: a `QuantLinear` of ``quantized[name]`` (keyed by the module's
    name in `model`), else an uninitialised ``nn.Linear`` of `dtype` on `device`. Returns the names made quantised.

    Raises:
        ValueError: a name in `quantized` that is not a linear layer of the model.
    """
    done = []
    deferred = {name: m for name, m in model.named_modules() if isinstance(m, DeferredLinear)}
    unknown = sorted(set(quantized) - set(deferred))
    if unknown:
        raise ValueError(f"quantised checkpoint modules with no linear layer in the model: {unknown[:4]}")
    for name, module in deferred.items():
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        tied = module._parameters.get("weight")
        if name in quantized:
            new: nn.Module = QuantLinear(module.in_features, module.out_features, module.has_bias, quantized[name],
                                         name, dtype).to(device)
            done.append(name)
        else:
            new = nn.utils.skip_init(nn.Linear, module.in_features, module.out_features, bias=module.has_bias,
                                     device=device, dtype=dtype)
            if tied is not None:
                new.weight = tied
        setattr(parent, name.rpartition(".")[2], new)
    return done


def linear_no_bias(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x W^T`` of an ``nn.Linear`` or a `QuantLinear`, without its bias."""
    if isinstance(layer, QuantLinear):
        return layer(x, add_bias=False)
    return F.linear(x, layer.weight)


class DequantizedSlice:
    """A quantised module's weight as a safetensors-like slice of its dequantised float32 values: the same
    ``get_shape`` [N, K]; indexing dequantises the whole weight once (a slice never indexed costs nothing).

    Args:
        module: the checkpoint module name.
        scheme: how it is stored.
        get: the checkpoint's tensor reader (`pd_cluster.engine.quant.loading.Reader`).
    """

    def __init__(self, module: str, scheme: WeightScheme, get: Reader) -> None:
        self.module, self.scheme, self._get = module, scheme, get
        self._values: torch.Tensor | None = None

    def _dequantized(self) -> torch.Tensor:
        if self._values is None:
            parts = read_module(self.module, self.scheme, self._get)
            n, k = parts["shape"] if "shape" in parts else parts["weight"].shape
            layer = QuantLinear(k, n, False, self.scheme, self.module)
            layer.load_part((0, n), parts)
            self._values = layer.dequantized()
        return self._values

    def get_shape(self) -> list[int]:
        return list(self._dequantized().shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        return self._dequantized()[index]
