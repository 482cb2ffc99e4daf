"""`bench/scripts/ep_comm.py` in smoke mode: two rank processes over gloo run the engine's DP-attention exchanges
and TP all-reduces; the bytes per layer are the layouts' formulas, and the routed all-to-all never sends more than
each token once to the other rank and back."""

from __future__ import annotations

import pytest

from pd_cluster.bench.scripts import ep_comm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_smoke_bytes_follow_each_layouts_formula():
    shape = ep_comm.Shape(hidden=64, experts=8, top_k=2, moe_layers=3, dtype="fp32")
    rows = ep_comm.measure(shape, ranks=2, tokens=[1, 4, 16], iters=2)
    assert [r["tokens"] for r in rows] == [1, 4, 16]
    for r in rows:
        t, row_bytes = r["tokens"], 64 * 4
        assert r["tp_bytes"] == 2 * 2 * 1 * t * row_bytes  # two ring all-reduces of [2 T, H]: half of each sent
        assert r["gather_bytes"] == 2 * t * row_bytes      # the other rank's T rows out, its partial rows back
        assert 0 <= r["routed_bytes"] <= t * (row_bytes + 2 * 2 * 4) + t * row_bytes
        assert all(r[k] > 0 for k in ("tp_ms", "gather_ms", "routed_ms"))
    assert rows[-1]["routed_bytes"] > 0  # 16 tokens choosing 2 of 8 experts: some cross to the other rank
    text = ep_comm.table(shape, 2, rows)
    assert "| 16 | 32 |" in text and "EP / TP bytes" in text
