"""The packed step: pack -> unpack gives back exactly what rank 0 packed, and the batch every rank builds from it
(device rows + appends) equals the batch built from whole host page lists (`build_forward_batch`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_cluster.engine.batch import HostStaging, build_forward_batch
from pd_cluster.engine.block_tables import BlockTableRows, DeviceBlockTable
from pd_cluster.engine.packed_step import HEADER_LEN, STEP_MAGIC, build_step, pack_step, payload_len, unpack_step

PAGE = 4
CPU = torch.device("cpu")


def _random_step(rng: np.random.Generator, tracker: BlockTableRows, tables: dict[str, list[int]],
                 computed: dict[str, int]):
    """A step over every request in `tables`: some decode (1 token), the rest prefill a chunk."""
    names = list(tables)
    rng.shuffle(names)
    n_dec = int(rng.integers(0, len(names) + 1))
    ids, starts, qlens, logits, per_req_logits = [], [], [], [], []
    n_tok = 0
    for i, name in enumerate(names):
        q = 1 if i < n_dec else int(rng.integers(1, 9))
        start = computed[name]
        need = -(-(start + q) // PAGE)
        while len(tables[name]) < need:  # pages appended as the request grows
            tables[name].append(int(rng.integers(1, 10_000)))
        ids.extend(rng.integers(0, 500, q).tolist())
        starts.append(start)
        qlens.append(q)
        want = sorted(set(rng.integers(0, q, int(rng.integers(0, 3))).tolist()) | {q - 1})
        per_req_logits.append(np.asarray(want, dtype=np.int64))
        logits.extend(n_tok + w for w in want)
        n_tok += q
        computed[name] = start + q
    rows, edits = tracker.step(names, [tables[n] for n in names])
    return names, n_dec, (ids, starts, qlens, rows, logits, n_dec, edits), per_req_logits


def test_pack_unpack_round_trips_exactly():
    rng = np.random.default_rng(0)
    tracker = BlockTableRows()
    tables = {f"r{i}": [] for i in range(6)}
    computed = dict.fromkeys(tables, 0)
    for _ in range(5):
        _, _, fields, _ = _random_step(rng, tracker, tables, computed)
        ids, starts, qlens, rows, logits, n_dec, edits = fields
        flat = pack_step(*fields)
        assert flat.dtype == np.int64 and flat[0] == STEP_MAGIC
        assert flat.size == HEADER_LEN + payload_len(flat[:HEADER_LEN])
        got = unpack_step(flat[:HEADER_LEN], flat[HEADER_LEN:].copy())
        assert got.input_ids.tolist() == ids and got.starts.tolist() == starts and got.query_lens.tolist() == qlens
        assert got.rows.tolist() == rows and got.logits.tolist() == logits and got.num_decodes == n_dec
        for field in ("clear", "seg_rows", "seg_cols", "seg_lens", "ids"):
            assert np.array_equal(getattr(got.edits, field), getattr(edits, field)), field


def test_header_and_payload_are_checked():
    flat = pack_step([1], [0], [1], [0], [0], 0, BlockTableRows().step(["a"], [[3]])[1])
    bad = flat[:HEADER_LEN].copy()
    bad[0] = 0
    with pytest.raises(ValueError, match="not a packed step"):
        unpack_step(bad, flat[HEADER_LEN:])
    with pytest.raises(ValueError, match="announces"):
        unpack_step(flat[:HEADER_LEN], flat[HEADER_LEN:-1])


@pytest.mark.parametrize("staged", [False, True])
def test_device_rows_build_the_same_batch_as_host_page_lists(staged):
    rng = np.random.default_rng(1)
    tracker = BlockTableRows()
    table = DeviceBlockTable(CPU)
    staging = HostStaging(CPU) if staged else None
    tables = {f"r{i}": [] for i in range(5)}
    computed = dict.fromkeys(tables, 0)
    for step_no in range(12):
        if step_no == 6:  # one request leaves, one joins, one gets a fresh page list (a readmission)
            tracker.release("r0")
            del tables["r0"], computed["r0"]
            tables["r9"], computed["r9"] = [], 0
            tables["r1"], computed["r1"] = [], 0
        names, n_dec, fields, per_req = _random_step(rng, tracker, tables, computed)
        flat = pack_step(*fields)
        got = build_step(unpack_step(flat[:HEADER_LEN], flat[HEADER_LEN:]), table, PAGE, staging)
        ids, starts, qlens = fields[0], fields[1], fields[2]
        splits = np.split(np.asarray(ids, dtype=np.int64), np.cumsum(qlens)[:-1])
        want = build_forward_batch(splits, starts, [tables[n] for n in names], per_req, n_dec, PAGE, CPU)
        for f in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                  "logits_indices"):
            a, b = getattr(got, f), getattr(want, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (step_no, f)
        assert got.num_decodes == want.num_decodes and got.seq_lens_cpu == want.seq_lens_cpu
        assert got.query_lens_cpu == want.query_lens_cpu and got.query_start_loc_cpu == want.query_start_loc_cpu
    assert tracker.rewrites == 1


def test_a_row_short_of_pages_is_refused():
    tracker = BlockTableRows()
    rows, edits = tracker.step(["a"], [[7]])  # one page of 4 tokens
    flat = pack_step([1] * 5, [0], [5], rows, [4], 0, edits)  # 5 tokens need 2 pages
    table = DeviceBlockTable(CPU)
    with pytest.raises(ValueError, match="needs 2"):
        build_step(unpack_step(flat[:HEADER_LEN], flat[HEADER_LEN:]), table, PAGE, None)
    assert np.array_equal(table.table.numpy(), table.host) and table.host[rows[0], 0] == 7  # still in step


def test_a_decode_step_packs_into_bytes_that_do_not_grow_with_the_contexts():
    """28 decodes over 32k-token contexts (2,048 pages each, page 16): once the rows hold the pages, a step is
    8 x (12 + 5 x 28) bytes, and 32 bytes more per appended page; the context length does not enter."""
    tracker = BlockTableRows()
    names = [f"r{i}" for i in range(28)]
    tables = {n: list(range(1 + 2048 * i, 1 + 2048 * (i + 1))) for i, n in enumerate(names)}

    def step_bytes() -> int:
        rows, edits = tracker.step(names, [tables[n] for n in names])
        n = len(names)
        return pack_step([7] * n, [32767] * n, [1] * n, rows, list(range(n)), n, edits).nbytes

    assert step_bytes() > 28 * 2048 * 8  # the first step writes every row's pages once
    assert step_bytes() == 8 * (HEADER_LEN + 5 * 28) == 1216
    for i, n in enumerate(names):
        tables[n].append(100_000 + i)  # every request gains a page
    assert step_bytes() == 1216 + 28 * 32 == 2112


def test_a_second_kv_group_gets_its_own_rows_slots_and_tables():
    """Two KV groups: each request owns one row per group in the one device table; the batch of group 1 has
    that group's slots and block tables, group 0's fields are untouched."""
    tracker = BlockTableRows()
    table = DeviceBlockTable(CPU)
    g0 = {"a": [3, 4], "b": [7]}
    g1 = {"a": [0, 9], "b": [11]}  # request a's first page of group 1 is behind its window: the null page
    ids = ["a", "b", "a#1", "b#1"]
    rows, edits = tracker.step(ids, [g0["a"], g0["b"], g1["a"], g1["b"]])
    flat = pack_step([1, 2, 3, 4], [4, 0], [2, 2], rows[:2], [1, 3], 0, edits, group_rows=[rows[2:]])
    step = unpack_step(flat[:HEADER_LEN], flat[HEADER_LEN:])
    assert step.group_rows.tolist() == [rows[2:]]
    batch = build_step(step, table, PAGE, None)
    want0 = build_forward_batch([np.array([1, 2]), np.array([3, 4])], [4, 0], [g0["a"], g0["b"]],
                                [np.array([1]), np.array([1])], 0, PAGE, CPU)
    want1 = build_forward_batch([np.array([1, 2]), np.array([3, 4])], [4, 0], [g1["a"], g1["b"]],
                                [np.array([1]), np.array([1])], 0, PAGE, CPU)
    assert batch.for_group(0) is batch and torch.equal(batch.slot_mapping, want0.slot_mapping)
    assert torch.equal(batch.block_tables, want0.block_tables)
    one = batch.for_group(1)
    assert torch.equal(one.slot_mapping, want1.slot_mapping) and torch.equal(one.block_tables, want1.block_tables)
    assert not torch.equal(one.slot_mapping, batch.slot_mapping)


def test_longrope_factor_sets_travel_per_request_and_reach_each_token():
    """Requests a (2 tokens) and c (1) rotate by longrope's long factors, b (3) by the short ones: the step
    carries one value per request, the batch one per token; a step where every request is short carries none."""
    tracker = BlockTableRows()
    table = DeviceBlockTable(CPU)
    rows, edits = tracker.step(["a", "b", "c"], [[3], [5], [8]])
    flat = pack_step([1, 2, 3, 4, 5, 6], [0, 0, 0], [2, 3, 1], rows, [1, 4, 5], 0, edits, rope_variants=[1, 0, 1])
    step = unpack_step(flat[:HEADER_LEN], flat[HEADER_LEN:])
    assert step.rope_variants.tolist() == [1, 0, 1]
    assert build_step(step, table, PAGE, None).rope_variant.tolist() == [1, 1, 0, 0, 0, 1]
    short = pack_step([1], [2], [1], rows[:1], [0], 1, BlockTableRows().step(["a"], [[3]])[1], rope_variants=[0])
    assert short.size == pack_step([1], [2], [1], rows[:1], [0], 1, BlockTableRows().step(["a"], [[3]])[1]).size
    assert unpack_step(short[:HEADER_LEN], short[HEADER_LEN:]).rope_variants is None
