"""The KV store's metrics on a worker's registry (``serving/kv_store_metrics.py``), from real engines sharing a
file store in-process: the writer's written pages, bytes and batches; the reader's lookups, hits, bytes read,
latency and pages per read, its cached tokens by source; every ``vllm:`` twin equal to its ``pd:`` family."""

from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, generate_latest

from pd_cluster.bench import prom
from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.metrics import WorkerMetrics

PAGE = 16
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(3 * PAGE + 5)]  # 3 full pages and 5 tokens
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def engine_on(root) -> LLMEngine:
    return LLMEngine(config_from_kwargs(page_size=PAGE, num_pages=40, hicache_storage_backend="file",
                                        hicache_storage_backend_extra_config=json.dumps({"storage_dir": str(root)})))


def serve_one(engine: LLMEngine, metrics: WorkerMetrics, rid: str) -> None:
    engine.add_request(rid, PROMPT, PARAMS)
    deadline = time.monotonic() + 60
    while engine.has_work() and time.monotonic() < deadline:
        engine.step()
        metrics.on_step(engine)
    assert not engine.has_work()


def scrape_of(registry: CollectorRegistry, engine: LLMEngine):
    scrape = prom.parse(generate_latest(registry).decode())
    label = ("model_name", engine.model_name)

    def value(name: str, **labels: str) -> float:
        return scrape[(name, tuple(sorted([label, *labels.items()])))]
    return value


def test_the_writer_and_the_reader_count_what_moved(tmp_path):
    writer, reader = engine_on(tmp_path), engine_on(tmp_path)
    try:
        wreg, rreg = CollectorRegistry(), CollectorRegistry()
        wm, rm = WorkerMetrics(wreg, "mixed"), WorkerMetrics(rreg, "mixed")
        serve_one(writer, wm, "a")
        deadline = time.monotonic() + 10  # the writes are asynchronous
        while writer.l3.stats.written_pages < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        wm.on_step(writer)
        w = scrape_of(wreg, writer)
        assert w("pd:backuped_tokens_total") == 3 * PAGE
        assert w("pd:backup_pgs_sum") == 3 and w("pd:kv_store_write_latency_seconds_count") == w("pd:backup_pgs_count")
        wbytes = w("pd:kv_offload_total_bytes_total", transfer_type="GPU_to_STORAGE")
        assert wbytes == writer.l3.stats.write_bytes > 0
        assert w("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_STORAGE") == wbytes
        assert w("pd:kv_store_available") == 1
        assert w("pd:cached_tokens_total", cache_source="storage") == 0

        serve_one(reader, rm, "b")
        r = scrape_of(rreg, reader)
        assert r("pd:cached_tokens_total", cache_source="storage") == 3 * PAGE
        assert r("pd:cached_tokens_total", cache_source="device") == 0
        assert r("pd:prefetched_tokens_total") == r("pd:kv_store_hit_tokens_total") == 3 * PAGE
        assert r("pd:kv_store_lookup_tokens_total") == 3 * PAGE
        rbytes = r("pd:kv_offload_total_bytes_total", transfer_type="STORAGE_to_GPU")
        assert rbytes == reader.l3.stats.read_bytes > 0
        assert r("vllm:kv_offload_total_bytes_total", transfer_type="STORAGE_to_GPU") == rbytes
        assert r("pd:kv_offload_total_time_total", transfer_type="STORAGE_to_GPU") > 0
        assert r("pd:prefetch_pgs_sum") == 3 and r("pd:kv_store_read_latency_seconds_count") == 1
        assert r("pd:kv_store_corrupt_pages_total") == r("pd:kv_store_write_dropped_pages_total") == 0
        assert r("pd:kv_store_prefetch_timeouts_total") == r("pd:kv_store_disconnects_total") == 0
    finally:
        writer.close()
        reader.close()
