"""Host staging of a step's inputs (`HostStaging`): the same batch as seven separate copies, from persistent
buffers that are reused and grown, never aliased by an earlier step's batch, every tensor at a 128-byte offset."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pd_cluster.engine.batch import HostStaging, build_forward_batch
from kernel_cases import device

PAGE = 16


def _inputs(rng: np.random.Generator, num_decodes: int, num_prefills: int):
    ids, starts, tables, rows = [], [], [], []
    next_page = 1
    for i in range(num_decodes + num_prefills):
        new = 1 if i < num_decodes else int(rng.integers(1, 40))
        start = int(rng.integers(0, 200))
        need = -(-(start + new) // PAGE)
        ids.append(rng.integers(0, 1000, size=new).astype(np.int64))
        starts.append(start)
        tables.append(list(range(next_page, next_page + need)))
        next_page += need
        rows.append(np.array([new - 1]) if rng.random() < 0.8 else np.zeros(0, dtype=np.int64))
    return ids, starts, tables, rows, num_decodes


def _fields(batch):
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def test_staged_batches_equal_unstaged_ones_across_reuse_and_growth():
    rng = np.random.default_rng(0)
    staging = HostStaging(device())
    kept = []
    for nd, npf in [(3, 1), (1, 0), (0, 2), (40, 5), (200, 30), (2, 1)]:  # grows past the first 4096 elements
        ids, starts, tables, rows, num_decodes = _inputs(rng, nd, npf)
        want = build_forward_batch(ids, starts, tables, rows, num_decodes, PAGE, device())
        got = build_forward_batch(ids, starts, tables, rows, num_decodes, PAGE, device(), staging)
        for name, value in _fields(want).items():
            other = _fields(got)[name]
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and other.shape == value.shape and torch.equal(other, value), name
                # offsets are multiples of 128 bytes; the allocation itself is 64-byte aligned (CPU) or 512 (CUDA)
                assert other.device.type == device().type and other.data_ptr() % 64 == 0, name
            else:
                assert other == value, name
        kept.append((want, got))
    assert staging.uploads == 6
    for want, got in kept:  # an earlier batch is not overwritten by later uploads
        assert torch.equal(got.slot_mapping, want.slot_mapping) and torch.equal(got.block_tables, want.block_tables)


def test_only_integer_arrays_are_staged():
    with pytest.raises(ValueError, match="int64 and int32"):
        HostStaging(device()).upload([(np.zeros(3), torch.float32)])
