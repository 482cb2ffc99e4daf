"""Which GPUs each worker of a one-host cluster sees, and its memory share when workers must share a GPU.

``pd-serve --prefill-gpus 0-3 --decode-gpus 4-7`` gives each role its own devices; each worker takes the next
``--tp-size`` of its role's list as ``CUDA_VISIBLE_DEVICES`` (so its ranks are ``cuda:0..tp-1``, as a worker
expects). Without the flags, on a host with GPUs, workers take consecutive blocks of ``--tp-size`` devices,
prefill workers first, then decode (or the mixed workers). When there are fewer devices than the workers need,
the blocks wrap around and workers share devices: each sharing worker's ``--mem-fraction-static`` is then the
default fraction divided by how many workers share its busiest device (unless the flag was given), so two
workers on one GPU do not each plan for 88% of it. vLLM and SGLang run one role per process and leave
placement to the operator; this is the one-host convenience of ``pd-serve`` only.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

DEFAULT_MEM_FRACTION_STATIC = 0.88  # the engine's default on GPU (engine/config.py)


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)``.

    Raises:
        ValueError: a malformed item, a negative id, a reversed range or a repeated id.
    """
    ids: list[int] = []
    for item in text.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"GPU list {text!r}: {item!r} is not N or N-M")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"GPU list {text!r}: range {item!r} is reversed")
        ids += range(first, last + 1)
    if len(set(ids)) != len(ids):
        raise ValueError(f"GPU list {text!r} names a GPU twice")
    return tuple(ids)


@dataclass(frozen=True)
class GpuPlacement:
    """The devices of each worker (by name) and the ``--mem-fraction-static`` of workers that share one."""

    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    mem_fraction: dict[str, float] = field(default_factory=dict)

    def env(self, name: str) -> dict[str, str]:
        """The environment entries of worker `name` (``CUDA_VISIBLE_DEVICES``), empty for none."""
        ids = self.devices.get(name)
        return {} if ids is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}

    def argv(self, name: str) -> list[str]:
        """Extra worker flags of `name` (``--mem-fraction-static`` when it shares a device)."""
        f = self.mem_fraction.get(name)
        return [] if f is None else ["--mem-fraction-static", f"{f:.3f}"]


def plan_gpus(workers: list[tuple[str, str]], tp_size: int | dict[str, int], num_gpus: int,
              role_gpus: dict[str, tuple[int, ...]], mem_fraction_given: bool) -> GpuPlacement:
    """Place `workers` (``(name, role)`` in start order) on the host's `num_gpus` devices.

    Args:
        tp_size: every worker's ``--tp-size``, or each role's (``pd-serve --prefill-arg=--tp-size=2``): a worker
            takes that many devices.
        role_gpus: the devices of a role (``--prefill-gpus`` ...); a role without an entry uses all devices.
        mem_fraction_given: the operator set ``--mem-fraction-static`` (then it is never changed).

    Raises:
        ValueError: a role's list names a device the host does not have, or has fewer devices than one
            worker's ``--tp-size``.
    """
    if num_gpus <= 0:
        if role_gpus:
            raise ValueError("GPU lists were given, but this host has no CUDA device")
        return GpuPlacement()
    tp_of = tp_size if isinstance(tp_size, dict) else {}
    default_tp = 1 if isinstance(tp_size, dict) else tp_size
    for role, ids in role_gpus.items():
        if max(ids) >= num_gpus:
            raise ValueError(f"--{role}-gpus names GPU {max(ids)}, but this host has {num_gpus}")
        if len(ids) < tp_of.get(role, default_tp):
            raise ValueError(f"--{role}-gpus has {len(ids)} GPUs, fewer than --tp-size {tp_of.get(role, default_tp)} "
                             f"of the {role} workers")
    devices: dict[str, tuple[int, ...]] = {}
    shared_pool = tuple(range(num_gpus))
    cursor: Counter[str] = Counter()  # next block index, per list (a role's own, or the shared one)
    offset: Counter[str] = Counter()  # the shared list's next device, when roles take blocks of other sizes
    for name, role in workers:
        tp = tp_of.get(role, default_tp)
        pool, key = (role_gpus[role], role) if role in role_gpus else (shared_pool, "")
        if key == "" and tp_of:
            start = offset[key] % len(pool)
            offset[key] += tp
            devices[name] = tuple(pool[(start + i) % len(pool)] for i in range(tp))
            continue
        blocks = max(1, len(pool) // tp)
        start = (cursor[key] % blocks) * tp
        cursor[key] += 1
        devices[name] = pool[start:start + tp]
    users = Counter(gpu for ids in devices.values() for gpu in ids)
    mem_fraction = {}
    if not mem_fraction_given:
        for name, ids in devices.items():
            share = max(users[g] for g in ids)
            if share > 1:
                mem_fraction[name] = round(DEFAULT_MEM_FRACTION_STATIC / share, 3)
    return GpuPlacement(devices, mem_fraction)


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device files one of which every host with a GPU torch can use has: NVIDIA's driver (``/dev/nvidiactl``), ROCm
(``/dev/kfd``), WSL 2 (``/dev/dxg``)."""


def cuda_device_count(device_nodes: tuple[str, ...] = GPU_DEVICE_NODES) -> int:
    """Devices this host's CUDA runtime sees (0 without CUDA or torch's CUDA build).

    On a host without any of `device_nodes` the answer is 0 without importing torch (about 2 s of CPU that
    ``pd-serve`` spent before starting any process).
    """
    if not any(os.path.exists(node) for node in device_nodes):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver means no GPU placement, not a crash
        return 0
