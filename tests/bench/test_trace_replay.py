"""Acceptance 3: replaying a 200-request slice of the Mooncake trace reproduces its
inter-arrival times and its prefix sharing exactly: the planned send times are the trace's
(scaled), no request is sent before its time, and the token blocks of requests with equal
hash ids are equal (checked by re-tokenising the prompts sent). How late sends are (the
scheduler lag, p50/p99/max, 2 ms at p99 on an idle machine) depends on the machine's load, so
it is measured by `python -m pd_cluster.bench.scripts.send_rate` (docs/perf/bench.md), not here."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from bench_testkit import bench

from pd_cluster.bench.config import DatasetConfig, LengthScaling
from pd_cluster.bench.datasets import DEFAULT_PATHS, load_dataset
from pd_cluster.bench.datasets.traces import block_layout
from pd_cluster.bench.tokenizer import load_tokenizer, resolve_tokenizer_name

SLICE = str(DEFAULT_PATHS["mooncake-trace"])


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_tokenizer_name(None, "stories260K"))


def _rows(n: int) -> list[dict]:
    with open(SLICE) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scale,block", [pytest.param(1.0, 512, marks=pytest.mark.slow), (0.05, 26)])  # 1.0: runs long
def test_equal_hash_ids_give_equal_token_blocks(tok, scale, block):
    ds = load_dataset(DatasetConfig(name="mooncake-trace", num_prompts=200,
                                    scaling=LengthScaling(input_scale=scale)), tok)
    rows = _rows(200)
    assert len(ds.requests) == 200 and ds.requests[0].block_size == block
    seen: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for req, row, ids in zip(ds.requests, rows, tok.encode_batch([r.prompt for r in ds.requests])):
        assert req.prompt_len == len(ids) == max(1, round(row["input_length"] * scale))
        assert list(req.hash_ids) == row["hash_ids"]
        pos = 0
        for j, (h, n) in enumerate(block_layout(row["hash_ids"], len(ids), block)):
            if n >= block:  # a full block (the last one may be partial or absorb a remainder)
                seen[h].append(tuple(ids[pos:pos + block]))
            pos += n
        assert pos == len(ids)
    shared = {h: blocks for h, blocks in seen.items() if len(blocks) > 1}
    assert len(shared) >= 40  # the slice shares many prefixes (hash 0 is in most requests)
    for h, blocks in shared.items():
        assert all(b == blocks[0] for b in blocks), f"hash id {h}: blocks differ"
    firsts = {blocks[0] for blocks in seen.values()}
    assert len(firsts) == len(seen)  # distinct hash ids, distinct token blocks


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replay_reproduces_the_inter_arrival_times(fake_factory):
    fake = fake_factory("--ttft-ms", "0", "--itl-ms", "0", "--num-tokens", "2")
    speedup = 24.0
    res = bench(fake.url, "--dataset-name", "mooncake-trace", "--num-prompts", "200",
                "--trace-speedup", str(speedup), "--input-len-scale", "0.05", "--max-input-len", "400",
                "--output-len-scale", "0.01", "--max-output-len", "8", "--no-server-metrics")
    assert res["summary"]["completed"] == 200
    reqs = sorted(res["requests"], key=lambda r: r["index"])
    planned = np.array([r["planned_s"] for r in reqs])
    sent = np.array([r["started_s"] for r in reqs])
    trace = np.array([row["timestamp"] for row in _rows(200)]) / 1000.0 / speedup
    assert np.allclose(np.diff(planned), np.diff(trace), rtol=0, atol=1e-9)  # the schedule is the trace
    lag = sent - planned
    assert lag.min() >= 0, f"a request was sent {-lag.min() * 1e3:.3f} ms early"
    # deadlines, not accumulated sleeps: lateness does not build up over the 200 requests
    assert np.median(lag) < 0.05 and lag[-20:].mean() < lag[:20].mean() + 0.05, lag
    assert "Length scaling: input x0.05 (cap 400), output x0.01 (cap 8)" in res["config"]["resolved"]["scaling"]
