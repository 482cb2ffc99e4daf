"""`bench/scripts/hybrid_pd.py`: the tiny model has Scout's layer pattern, and one 1P1D run per mode moves, with KV
cache groups, the global layers' every page plus the chunked layers' last chunk, against every layer's every page
with one group, for the same tokens."""

from __future__ import annotations

import pytest

from pd_cluster.bench.scripts import hybrid_pd


@pytest.mark.slow  # starts two 1P1D clusters
@pytest.mark.timeout(600)
def test_groups_move_a_quarter_plus_the_chunks(tmp_path):
    from pd_cluster.engine.model.arch import ArchConfig

    hybrid_pd.build_model(tmp_path, 64, 512)
    kinds = [a.mask_key for a in ArchConfig.from_pretrained(tmp_path).layer_attention]
    assert kinds == ([("chunked", 64)] * 3 + [("full", 0)]) * 2
    grouped = hybrid_pd.run_mode(tmp_path, False, [200], 0)[0]
    single = hybrid_pd.run_mode(tmp_path, True, [200], 0)[0]
    assert grouped["token_ids"] == single["token_ids"] and len(grouped["token_ids"]) == 8
    layer_page = 2 * 2 * 16 * 16 * 4  # K and V of 2 KV heads x 16 tokens x 16 x fp32, one layer
    pages = -(-200 // 16)  # 13
    assert single["received"] == pages * 8 * layer_page and single["skipped"] == 0
    # 4 groups of 2 layers; position 200 reads the chunk from 192: page 12 only in each chunked group
    assert grouped["received"] == (pages + 3 * 1) * 2 * layer_page
    assert grouped["skipped"] == 3 * 12 * 2 * layer_page
