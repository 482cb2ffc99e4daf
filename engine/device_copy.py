"""Small host data onto the device without waiting for the device.

A copy from pageable host memory to CUDA synchronises the stream (torch waits
for it to finish so the host buffer may be freed), so the host waits for every
kernel already queued: one such copy per step undoes overlap scheduling and
stalls the engine thread behind the GPU. `to_device` stages through pinned
memory (torch's caching host allocator, which keeps the block until the copy's
event completes) and copies ``non_blocking``, as vLLM's ``async_tensor_h2d`` does.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a list of numbers, nested lists, or a numpy array) as a tensor on `device`.

    On CUDA the copy is asynchronous from pinned memory; elsewhere it is a plain copy.
    """
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
