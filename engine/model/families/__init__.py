"""The model family registry: one file per family, found by the ``architectures`` of a ``config.json``.

Each module of this package defines its family (a `pd_cluster.engine.model.family.Family` subclass: how the
config is read and checked, how weights are named, which model class runs it, what ``pd-plan`` sizes) and
lists its instances in ``FAMILIES``; every module here is imported and registered by architecture name, so
adding a family is adding one file. No architecture name appears outside this package
(``tests/layout/test_families.py``). Torch-free: the memory planner reads it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Iterable

from pd_cluster.engine.model.family import Family
from pd_cluster.engine.model.moe_config import MoEConfig


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for family in getattr(module, "FAMILIES", ()):
            if family.architecture in found:
                raise RuntimeError(f"{family.architecture} is registered twice ({info.name})")
            found[family.architecture] = family
    return found


REGISTRY: dict[str, Family] = _discover()


def supported_architectures() -> list[str]:
    """Every registered architecture name, sorted."""
    return sorted(REGISTRY)


def find(architectures: Iterable[str]) -> Family | None:
    """The family of the first registered name in `architectures`, None when there is none."""
    return next((REGISTRY[a] for a in architectures if a in REGISTRY), None)


def family_of(cfg: dict[str, Any]) -> Family:
    """The family of a parsed ``config.json``.

    Raises:
        ValueError: none of its ``architectures`` is registered (the message lists those that are).
    """
    archs = cfg.get("architectures") or []
    family = find(archs)
    if family is None:
        raise ValueError(f"unsupported architectures {archs}; supported: {supported_architectures()}")
    return family


def get(architecture: str) -> Family:
    """The family registered as `architecture` (`ArchConfig.architecture`).

    Raises:
        KeyError: not registered.
    """
    return REGISTRY[architecture]


def moe_from_hf(cfg: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE part of an HF config of `architecture` as its family reads it, None for a dense model.

    Raises:
        ValueError: a routing key with a value the engine does not implement, named.
        KeyError: `architecture` is not registered.
    """
    return get(architecture).moe(cfg)
