"""Shared test set-up: GPU skipping, and the real embedded model's reference outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))  # shared helpers, e.g. engine_reference


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that holds folder names too
            item.add_marker(skip)
