"""Persistent device block tables: rows appended to, rewritten when a page list changes otherwise, grown on
demand, released when requests leave the running set, with exact greedy output through all of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_reference import PROMPTS, hf_greedy

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.block_tables import INITIAL_ROWS, INITIAL_WIDTH, BlockTableRows, DeviceBlockTable
from pd_cluster.engine.llm_engine import LLMEngine

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


class Tables:
    """Rank 0's rows plus one rank's device table, driven as a step would drive them."""

    def __init__(self) -> None:
        self.rows = BlockTableRows()
        self.dev = DeviceBlockTable(CPU)
        self.last_edits = None

    def step(self, reqs: dict[str, list[int]]) -> list[int]:
        rows, edits = self.rows.step(list(reqs), list(reqs.values()))
        self.last_edits = edits
        idx, vals = self.dev.apply_host(edits, np.asarray(rows, dtype=np.int64))
        self.dev.apply_device(torch.from_numpy(edits.clear), torch.from_numpy(idx), torch.from_numpy(vals))
        return rows

    def row(self, r: int) -> list[int]:
        """Row `r` of the device table, checked against the host mirror."""
        dev = self.dev.table[r].tolist()
        assert dev == self.dev.host[r].tolist()
        return dev

    def appended(self) -> list[int]:
        return self.last_edits.ids.tolist()


def test_new_rows_then_appends_only():
    t = Tables()
    a, b = [5, 9], [3]
    ra, rb = t.step({"a": a, "b": b})
    assert (ra, rb) == (0, 1) and t.last_edits.clear.tolist() == [0, 1]
    assert t.row(ra)[:3] == [5, 9, 0] and t.row(rb)[:2] == [3, 0]
    a.append(11)
    t.step({"a": a, "b": b})
    assert t.appended() == [11] and t.last_edits.seg_cols.tolist() == [2] and not t.last_edits.clear.size
    assert t.row(ra)[:4] == [5, 9, 11, 0]
    t.step({"a": a, "b": b})  # nothing new
    assert not t.last_edits.ids.size and not t.last_edits.clear.size
    assert t.rows.rewrites == 0


@pytest.mark.parametrize("change", ["fresh list", "shorter", "page replaced in place"])
def test_a_change_other_than_appending_rewrites_the_row(change):
    t = Tables()
    old = [7, 8, 9, 10]
    (r,) = t.step({"a": old})
    if change == "fresh list":  # e.g. preempted and readmitted on a prefix-cache hit: a new list object
        new = [7, 8, 20, 21, 22]
    elif change == "shorter":
        new = old
        del new[2:]
    else:
        new = old
        new[3] = 99
    t.step({"a": new})
    assert t.rows.rewrites == 1 and t.last_edits.clear.tolist() == [r]
    assert t.appended() == new and t.row(r)[:len(new) + 1] == new + [0]  # the stale tail is cleared
    assert t.dev.lengths[r] == len(new)


def test_width_and_rows_grow_on_demand_keeping_contents():
    t = Tables()
    assert t.dev.shape == (INITIAL_ROWS, INITIAL_WIDTH)
    reqs = {f"r{i}": [i + 1] for i in range(INITIAL_ROWS + 3)}
    t.step(reqs)
    assert t.dev.shape == (2 * INITIAL_ROWS, INITIAL_WIDTH)
    long = list(range(100, 100 + 5 * INITIAL_WIDTH))  # 80 pages: the width doubles to 128
    reqs["r0"] = long
    t.step(reqs)
    assert t.dev.shape == (2 * INITIAL_ROWS, 8 * INITIAL_WIDTH)
    assert t.row(0)[:len(long)] == long
    assert all(t.row(i)[:2] == [i + 1, 0] for i in range(1, INITIAL_ROWS + 3))


def test_released_rows_are_reused_lowest_first():
    t = Tables()
    t.step({"a": [1], "b": [2], "c": [3]})
    t.rows.release("b")
    t.rows.release("a")
    t.rows.release("never-ran")  # ignored
    assert t.rows.num_used == 1
    assert t.step({"d": [4, 5]}) == [0]
    assert t.row(0)[:3] == [4, 5, 0]  # cleared for its new owner
    assert t.step({"e": [6]}) == [1] and t.rows.num_allocated == 3


def test_an_append_out_of_order_is_refused():
    t = Tables()
    t.step({"a": [1, 2]})
    _, edits = BlockTableRows().step(["x"], [[3, 4, 5]])  # another tracker: row 0, append from column 0
    edits.clear = np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="out of order"):
        t.dev.apply_host(edits, np.zeros(1, dtype=np.int64))
    assert t.row(0)[:3] == [1, 2, 0] and t.dev.lengths[0] == 2  # refused before anything changed


def _check_idle(engine: LLMEngine) -> None:
    rows = engine.runner.rows
    assert rows.num_used == 0, rows.owner_rows()
    assert rows.num_allocated <= engine.max_running_requests


def test_rows_come_back_after_aborts_and_retraction_with_exact_output():
    # The tiny pool forces retraction (as in test_page_accounting); aborts hit queued, prefilling and decoding
    # requests; a second wave reuses the rows.
    engine = LLMEngine(config_from_kwargs(page_size=16, num_pages=20, chunked_prefill_size=7,
                                          schedule_conservativeness=0.1))
    outs: dict[str, list[int]] = {}
    aborted_at = {"w0-r1": 0, "w0-r2": 3, "w0-r5": 40}
    for wave in range(2):
        ids = [f"w{wave}-r{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            engine.add_request(rid, prompt, GREEDY_64)
        for step in range(2000):
            for rid, when in aborted_at.items():
                if step == when and rid in engine.requests:
                    engine.abort_request(rid)
            for d in engine.step().deltas:
                outs.setdefault(d.request_id, []).extend(d.new_token_ids)
            assert engine.runner.rows.num_used <= len(engine.scheduler.running)
            if not engine.has_work():
                break
        _check_idle(engine)
    assert engine.scheduler.num_retracted_total > 0
    for wave in range(2):
        for i, prompt in enumerate(PROMPTS):
            rid = f"w{wave}-r{i}"
            if rid not in aborted_at:
                assert tuple(outs[rid]) == hf_greedy(prompt, 64, "fp32"), rid
    assert engine.num_free_pages() == engine.allocator.num_pages


def test_a_readmitted_request_is_rewritten_even_without_its_release():
    """With the release hook cut, retracted requests keep their rows; readmitted with fresh page lists (prefix-cache
    hits included), their rows must be detected as changed and rewritten, or the output would be wrong."""
    llm = LLM(page_size=16, num_pages=20, schedule_conservativeness=0.1)
    engine = llm.engine
    engine.scheduler.on_leave = None
    outs = llm.generate(PROMPTS, GREEDY_64)
    assert engine.scheduler.num_retracted_total > 0
    assert engine.runner.rows.rewrites > 0
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, "fp32"), prompt
    assert engine.runner.rows.num_used == len(PROMPTS)  # and, without the hook, every row leaked


def test_context_length_does_not_size_any_block_table(monkeypatch):
    from pd_cluster.engine.executor.shard import Shard
    from pd_cluster.engine.graph import CudaGraphRunner, graph_table_pages
    configs = []
    monkeypatch.setattr(Shard, "capture_decode_graphs", lambda self, config: configs.append(config) or [])
    small = LLMEngine(config_from_kwargs(context_length=4096, num_pages=64))
    huge = LLMEngine(config_from_kwargs(context_length=10_000_000, num_pages=64))
    assert small.shard.block_table.shape == huge.shard.block_table.shape == (INITIAL_ROWS, INITIAL_WIDTH)
    assert configs[0] == configs[1] and configs[0].max_context_len is None  # from the pool, not the context
    from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend
    runner = CudaGraphRunner(torch.nn.Identity(), huge.pool, TritonAttentionBackend(4, 2, 16, 0.25), configs[1])
    assert runner.buffers.max_pages == graph_table_pages(configs[1].max_bs, 64) == 64


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_ranks_keep_identical_tables_through_retraction():
    llm = LLM(tp_size=2, page_size=16, num_pages=20, schedule_conservativeness=0.1)
    try:
        engine = llm.engine
        outs = llm.generate(PROMPTS, GREEDY_64)
        states = engine.tp_driver.call("block_table_state", gather=True)
    finally:
        llm.engine.close()
    assert engine.scheduler.num_retracted_total > 0
    for prompt, out in zip(PROMPTS, outs):
        assert tuple(out.token_ids) == hf_greedy(prompt, 64, "fp32"), prompt
    (t0, len0, mirror0), (t1, len1, mirror1) = states
    assert mirror0 and mirror1 and np.array_equal(t0, t1) and np.array_equal(len0, len1)
    assert len0.max() > 0 and engine.runner.rows.num_used == 0
