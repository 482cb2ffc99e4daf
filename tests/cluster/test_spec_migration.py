"""Migration with speculative decoding on: a real 1P2D cluster whose decode workers draft with a draft model
(STANDALONE). Greedy streams (a regex grammar, a named tool call, logprobs) start on decode-0, which is killed
(SIGKILL) mid-stream: every stream continues on decode-1 after the tokens already relayed (accepted tokens only
ever leave a worker) and equals the undisturbed run, which equals the engine without speculation; every page
comes back, the draft pools' included (`test_migration_replay.migrate_every_stream`: the decode is frozen before
the spare comes back, and each stream's migration is read from the router's log)."""

from __future__ import annotations

import asyncio

import pytest
from cluster_util import running_cluster, wait_all_free
from draft_models import shallow_stories_draft
from test_migration_replay import STORY, _all, _check_valid, migrate_every_stream
from test_spec_pd_serve import spec_totals

from pd_cluster.engine import LLM, SamplingParams

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

NAMES = ["regex", "tool_named", "logprobs"]  # greedy: drafted (seeded or penalised requests are not)


def test_kill_decode_mid_stream_with_a_draft_model_migrates_exactly(tmp_path):
    draft = shallow_stories_draft(tmp_path / "draft")
    argv = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft]
    with running_cluster(1, 2, engine_argv=argv, router_argv=["--upstream-idle-timeout-secs", "5",
                                                              "--request-timeout-secs", "240"]) as cluster:
        reference = asyncio.run(_all(cluster.router_url, NAMES, "reference"))
        for name, ref in zip(NAMES, reference):
            _check_valid(name, ref)
        plain = LLM().generate(STORY, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
        assert reference[NAMES.index("logprobs")]["text"] == plain.text
        spare = migrate_every_stream(cluster, NAMES, reference)
        total = spec_totals({"decode": spare})  # the continuations were drafted and verified where they moved
        assert 0 < total("decode", "num_accepted_tokens") < total("decode", "num_draft_tokens")
        loads = wait_all_free(cluster, timeout=30)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        assert all(v["draft_num_free_pages"] == v["draft_num_total_pages"] for v in loads.values()
                   if v["role"] == "decode"), loads
