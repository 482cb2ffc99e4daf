"""`bench/scripts/autoscale_stability.py`'s load: the shipped Azure trace sped up and looped end to end for the
run's length, its lengths scaled and capped under the model's context (no cluster started here)."""

from __future__ import annotations

import argparse

from pd_cluster.bench.scripts import autoscale_stability as script


def test_the_trace_is_sped_up_looped_and_fits_the_model():
    a = argparse.Namespace(trace=script.TRACE, minutes=5.0, speedup=4.0, input_scale=0.1, max_input_len=384,
                           max_output_len=64, seed=0)
    reqs, plan = script.workload(a)
    times = list(plan.times)
    assert times == sorted(times) and times[0] == 0.0 and 2 * 131 < times[-1] < 300  # into the third pass
    # 1,000 rows over 522 s at 4x: 131 s a pass, so 5 minutes hold two whole passes and part of a third
    assert 2000 < len(reqs) < 3000 and reqs[0].prompt == reqs[1000].prompt
    assert abs(times[1000] - 131.0) < 1.0
    assert max(r.prompt_len + r.output_len for r in reqs) <= 384 + 1 + 64 < 512  # BOS included


def test_its_flags_make_the_cluster_spec_it_starts():
    """The script builds its cluster with the goodput script's `spec` from its own flags (a flag that `spec` reads
    and this parser lacks broke the script once)."""
    for argv, forked in (([], True), (["--no-fork-workers"], False)):
        a = script.build_parser().parse_args(argv)
        cluster = script.spec(a, 1, 1)
        assert (cluster.num_prefill, cluster.num_decode, cluster.fork_workers) == (1, 1, forked)
        assert script.planner_config(a, a.max_prefill, a.max_decode).max_decode == 2
