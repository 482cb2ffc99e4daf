"""`bench/scripts/long_context.py`: the tiny hybrid model it builds is the one it describes, and one run measures
a prefill with the pages it held (in this process; the script runs each in a fresh one)."""

from __future__ import annotations

from pd_cluster.bench.scripts import long_context


def test_one_run_measures_a_prefill_of_the_hybrid_model(tmp_path):
    long_context.build_model(tmp_path, 2048)
    from pd_cluster.engine.model.arch import ArchConfig

    arch = ArchConfig.from_pretrained(tmp_path)
    assert [a.mask_key for a in arch.layer_attention] == [("chunked", 8192)] * 3 + [("full", 0)]
    assert [a.rope for a in arch.layer_attention] == [True] * 3 + [False]
    row = long_context.run_one(str(tmp_path), 1500, "cpu")
    assert row["seconds"] > 0 and row["pages"] == 94 and row["layers"] == 4  # the global layer: every page
    chunked = (-(-(8191 + 8192) // 16) + 1)  # a chunked group's bound; a 1,500-token prompt holds all its pages
    assert row["pages_by_group"] == [("full x1", 94)] + [("chunked(8192) x1", min(94, chunked))] * 3
    assert row["peak_rss"] >= row["ready_rss"] > 0
    assert long_context.old_scores_bytes(131072) == 4 * 8192 * 131072 * 4  # 16 GiB
