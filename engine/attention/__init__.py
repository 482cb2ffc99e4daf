"""Attention backends behind one interface (`AttentionBackend`), chosen by name.

``torch``: the reference, any device. ``cpu``: a compiled CPU decode kernel
plus the reference for prefill chunks. ``triton``: the GPU fast path (also runs
under ``TRITON_INTERPRET=1``). ``auto``: triton on CUDA when triton imports;
on CPU the compiled kernel when it builds, else torch.
"""

from __future__ import annotations

from importlib import import_module

import torch

from pd_cluster.engine.attention.base import AttentionBackend

_REGISTRY = {
    "torch": ("pd_cluster.engine.attention.torch_ref", "TorchAttentionBackend"),
    "cpu": ("pd_cluster.engine.attention.cpu_backend", "CpuAttentionBackend"),
    "triton": ("pd_cluster.engine.attention.triton_backend", "TritonAttentionBackend"),
}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """Map ``auto`` to a concrete backend for `device`."""
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import_module("triton")
            import_module(_REGISTRY["triton"][0])
            return "triton"
        except ImportError:
            return "torch"
    from pd_cluster.engine.attention import cpu_backend

    return "cpu" if cpu_backend.available() else "torch"


def get_backend(name: str, device: torch.device, **kwargs) -> AttentionBackend:
    """Instantiate the backend `name` (``auto``, ``torch`` or ``triton``).

    Raises:
        ValueError: unknown name.
        ImportError: the backend's dependencies (triton) are missing.
    """
    name = resolve_backend_name(name, device)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_REGISTRY)} or auto")
    module, cls = _REGISTRY[name]
    return getattr(import_module(module), cls)(**kwargs)


__all__ = ["AttentionBackend", "get_backend", "resolve_backend_name"]
