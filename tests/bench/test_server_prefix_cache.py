"""pd-bench reports the server-side prefix-cache hit rate from vLLM's counters, exactly: the fake's
emulated cache (full pages, chained, last prompt token never served) gives known hits for
generated-shared-prefix prompts."""

from __future__ import annotations

import pytest
from bench_testkit import bench

from pd_cluster.bench.config import DatasetConfig
from pd_cluster.bench.datasets import load_dataset
from pd_cluster.bench.fake_cache import FakePrefixCache
from pd_cluster.bench.tokenizer import load_tokenizer, resolve_tokenizer_name

GSP = ("--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
       "--gsp-system-prompt-len", "64", "--gsp-question-len", "16", "--gsp-output-len", "2")


def test_fake_prefix_cache_counts_full_chained_pages():
    c = FakePrefixCache(page_size=4)
    assert c.lookup_and_insert(list(range(10))) == 0
    assert c.lookup_and_insert(list(range(10))) == 8  # two full pages; the third is partial
    assert c.lookup_and_insert(list(range(8))) == 4  # the last token is recomputed: page 2 cannot hit
    assert c.lookup_and_insert([9] + list(range(1, 12))) == 0  # a different first page breaks the chain
    assert c.lookup_and_insert(list(range(12))) == 8
    assert c.lookup_and_insert(list(range(13))) == 12


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_summary_reports_the_servers_prefix_cache_hit_rate(fake_factory, capsys):
    tok_path = resolve_tokenizer_name(None, "stories260K")
    fake = fake_factory("--ttft-ms", "1", "--itl-ms", "1", "--page-size", "16", "--tokenizer", tok_path,
                        "--enable-prefix-caching")
    res = bench(fake.url, *GSP)
    ds = load_dataset(DatasetConfig(name="generated-shared-prefix", gsp_num_groups=2, gsp_prompts_per_group=3,
                                    gsp_system_prompt_len=64, gsp_question_len=16, gsp_output_len=2),
                      load_tokenizer(tok_path))
    assert [r.prompt_len for r in ds.requests] == [80] * 6
    # The fake counts the BOS too: 81 units; the first 4 pages (BOS + 63 system tokens) are shared in a
    # group, the 5th mixes the system prompt's last token with the question. 2 groups x 2 later prompts.
    queries, hits = 6 * 81, 2 * 2 * 64
    pc = res["server_breakdown"]["prefix_cache"]
    assert pc == [{"role": "mixed", "queries": queries, "hits": hits, "hit_rate": hits / queries}]
    assert res["summary"]["server_prefix_cache_hit_rate"] == hits / queries
    out = capsys.readouterr().out
    assert f"{'Prefix cache hit rate (server, %):':<40} {100 * hits / queries:.2f}" in out
    assert f"{'Prefix cache hits [mixed] (tokens):':<40} 256 of 486" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_hit_rate_without_server_metrics(fake_factory):
    fake = fake_factory("--ttft-ms", "1", "--itl-ms", "1")
    res = bench(fake.url, *GSP, "--no-server-metrics")
    assert "server_prefix_cache_hit_rate" not in res["summary"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_hit_rate_when_the_server_exports_no_prefix_cache_counters(fake_factory):
    fake = fake_factory("--ttft-ms", "1", "--itl-ms", "1")
    res = bench(fake.url, *GSP)
    assert res["server_breakdown"]["prefix_cache"] == []
    assert res["summary"]["server_prefix_cache_hit_rate"] is None
