"""Acceptance: the cluster-wide KV store behind the prefix cache (``--hicache-storage-backend file``), offline.

Two engines share a store directory, as two workers share one: the second serves the first's prefixes from the
store, and its greedy outputs equal the outputs with every cache off, token for token (fp32 and FP8 KV; with and
without the host tier). Pages corrupted in the store are refused and recomputed (0 wrong tokens); an engine of
another model (same layout, other weights) reads none of them; a store that fails mid-run costs hits, never a
request, and is used again once it answers; an unreachable store at start-up is a warning, or an error when
required. The same paths against Mooncake Store, across processes: ``tests/cluster/test_kv_store_pd.py``.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
from test_prefix_cache_exact import GREEDY, cache_off, shared_prefix_prompts

from pd_cluster.engine import LLM
from pd_cluster.engine.kv.l3 import tier as tier_mod
from pd_cluster.engine.kv.l3.backends import FileBackend, StoreUnavailable


def store_llm(root: Path, kv: str = "fp32", **kw) -> LLM:
    extra = json.dumps({"storage_dir": str(root), **kw.pop("extra", {})})
    return LLM(kv_cache_dtype=kv, page_size=16, chunked_prefill_size=7, hicache_storage_backend="file",
               hicache_storage_backend_extra_config=extra, **kw)


def pages_in(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


def run(llm: LLM) -> list[tuple[int, ...]]:
    outs = llm.generate([list(p) for p in shared_prefix_prompts()], GREEDY)
    return [tuple(o.token_ids) for o in outs]


def flush(llm: LLM) -> None:
    """Wait until the engine's queued writes are in the store."""
    import time

    deadline = time.monotonic() + 10
    while llm.engine.l3._queued_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("kv", ["fp32", "fp8_e4m3"])
def test_a_second_engine_serves_the_firsts_prefixes_from_the_store(tmp_path, kv):
    expected = list(cache_off(kv, 16))
    first = store_llm(tmp_path, kv)
    assert run(first) == expected
    flush(first)
    written = first.engine.l3.stats.written_pages
    assert written > 0 and len(pages_in(tmp_path)) == written
    second = store_llm(tmp_path, kv)
    recorder = second.engine.l3.backend = RecordingBackend(tmp_path)
    assert run(second) == expected
    st, l3 = second.engine.stats, second.engine.l3.stats
    assert st.storage_cache_hits > 0 and st.storage_cache_hits == l3.loaded_pages * 16
    flush(second)
    assert l3.corrupt_pages == 0
    assert recorder.read and not recorder.read & recorder.written  # what it read it does not write again
    # fewer prompt tokens computed than the first engine, by what the store served
    assert st.prompt_tokens_total < first.engine.stats.prompt_tokens_total
    assert st.external_prefix_cache_hits == st.storage_cache_hits
    engine = second.engine
    assert engine.pages.num_in_use == 0 and engine.num_free_pages() == engine.allocator.num_pages
    first.engine.close()
    second.engine.close()


@pytest.mark.slow  # ~5 s on a loaded 2-core machine
def test_store_behind_the_host_tier_and_a_small_pool(tmp_path):
    expected = list(cache_off("fp32", 16))
    kw = dict(num_pages=300 // 16, max_running_requests=2, enable_hierarchical_cache=True, hicache_ratio=1.0)
    first = store_llm(tmp_path, **kw)
    assert run(first) == expected and run(first) == expected
    flush(first)
    second = store_llm(tmp_path, **kw)
    assert run(second) == expected and run(second) == expected
    st = second.engine.stats
    assert st.storage_cache_hits > 0 and second.engine.l3.stats.corrupt_pages == 0
    assert st.prefix_cache_hits + st.external_prefix_cache_hits == st.cached_tokens_total
    first.engine.close()
    second.engine.close()


@pytest.mark.parametrize("damage", ["payload", "truncate", "swap"])
def test_corrupted_pages_are_recomputed_never_used(tmp_path, damage, caplog):
    expected = list(cache_off("fp32", 16))
    first = store_llm(tmp_path)
    run(first)
    flush(first)
    files = sorted(pages_in(tmp_path))
    blobs = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        b = bytearray(blobs[i])
        if damage == "payload":
            b[len(b) // 2] ^= 0x40  # one bit of KV
        elif damage == "truncate":
            b = b[:len(b) - 7]
        else:
            b = bytearray(blobs[(i + 1) % len(files)])  # another page's whole, valid value
        f.write_bytes(bytes(b))
    second = store_llm(tmp_path)
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert run(second) == expected
    l3 = second.engine.l3.stats
    assert l3.corrupt_pages > 0 and l3.loaded_pages == 0 and second.engine.stats.storage_cache_hits == 0
    assert "refused" in caplog.text
    first.engine.close()
    second.engine.close()


def test_another_model_on_the_same_store_reads_nothing(tmp_path):
    """Same architecture, page size and dtype (so the same KV layout), other weights: other keys."""
    first = store_llm(tmp_path, load_format="dummy", seed=1)
    run(first)
    flush(first)
    assert first.engine.l3.stats.written_pages > 0
    off = LLM(page_size=16, chunked_prefill_size=7, disable_radix_cache=True, load_format="dummy", seed=2)
    expected = [tuple(o.token_ids) for o in off.generate([list(p) for p in shared_prefix_prompts()], GREEDY)]
    other = store_llm(tmp_path, load_format="dummy", seed=2)
    assert other.engine.layout.hash() == first.engine.layout.hash()
    assert other.engine.l3.namespace.prefix != first.engine.l3.namespace.prefix
    assert run(other) == expected
    l3 = other.engine.l3.stats
    assert l3.lookup_pages > 0 and l3.hit_pages == 0 and l3.corrupt_pages == 0
    first.engine.close()
    other.engine.close()


class RecordingBackend(FileBackend):
    """A file store that remembers the keys read and written."""

    def __init__(self, root):
        super().__init__(root)
        self.read, self.written = set(), set()

    def get(self, keys):
        self.read.update(keys)
        return super().get(keys)

    def put(self, items):
        self.written.update(k for k, _ in items)
        return super().put(items)


class FlakyBackend(FileBackend):
    """A file store that fails every call while `down` is set."""

    down = False

    def _check(self):
        if self.down:
            raise StoreUnavailable("store down (test)")

    def exists(self, keys):
        self._check()
        return super().exists(keys)

    def put(self, items):
        self._check()
        return super().put(items)

    def reconnect(self):
        self._check()
        super().reconnect()

    def ping(self):
        self._check()
        super().ping()


def wait_until(check, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def test_an_idle_worker_learns_that_the_store_went_away_and_came_back(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_mod, "RECONNECT_SECS", 0.05)
    llm = store_llm(tmp_path)
    flaky = FlakyBackend(tmp_path)
    l3 = llm.engine.l3
    l3.backend = flaky
    assert l3.available
    flaky.down = True  # no request runs: only the health check can tell
    assert wait_until(lambda: not l3.available) and l3.stats.disconnects == 1
    flaky.down = False
    assert wait_until(lambda: l3.available) and l3.stats.disconnects == 1
    llm.engine.close()


def test_a_store_that_fails_mid_run_costs_hits_not_requests(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_mod, "RECONNECT_SECS", 0.05)
    expected = list(cache_off("fp32", 16))
    first = store_llm(tmp_path)
    run(first)
    flush(first)
    second = store_llm(tmp_path)
    flaky = FlakyBackend(tmp_path)
    second.engine.l3.backend = flaky
    flaky.down = True
    assert run(second) == expected  # served without the store
    l3 = second.engine.l3
    assert not l3.available and l3.stats.disconnects == 1 and l3.stats.loaded_pages == 0
    flaky.down = False
    import time

    deadline = time.monotonic() + 5
    while not l3.available and time.monotonic() < deadline:
        time.sleep(0.02)
    assert l3.available
    second.engine.prefix_cache.clear()
    assert run(second) == expected
    assert l3.stats.loaded_pages > 0  # read again once it answered
    first.engine.close()
    second.engine.close()


def test_unreachable_store_at_start_up_warns_or_fails_when_required(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="engine"):
        llm = store_llm(blocked / "store")
    assert "unreachable at start-up" in caplog.text and not llm.engine.l3.available
    outs = llm.generate([[5, 6, 7] * 20], GREEDY)
    assert len(outs[0].token_ids) == GREEDY.max_tokens
    llm.engine.close()
    with pytest.raises(RuntimeError, match="hicache-storage-required"):
        store_llm(blocked / "store", hicache_storage_required=True)
    # Mooncake: a master that is not there is found out at once (no 90 s of client retries). The port is held,
    # bound but not listening, so nothing else on the host can answer on it while the test runs.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        mooncake = json.dumps({"master_server_address": f"127.0.0.1:{held.getsockname()[1]}"})
        with pytest.raises(RuntimeError, match="cannot connect to the Mooncake master"):
            LLM(page_size=16, hicache_storage_backend="mooncake", hicache_storage_backend_extra_config=mooncake,
                hicache_storage_required=True)


def test_flags_follow_sglangs_names_and_refuse_what_is_not_built():
    from pd_cluster.engine.args import config_from_kwargs

    cfg = config_from_kwargs(hicache_storage_backend="mooncake", hicache_storage_prefetch_policy="best_effort",
                             hicache_storage_backend_extra_config='{"master_server_address": "m:1"}')
    assert cfg.cache.hicache_storage_backend == "mooncake"
    with pytest.raises(ValueError, match="one of"):
        config_from_kwargs(hicache_storage_backend="3fs")
    with pytest.raises(ValueError, match="JSON object"):
        config_from_kwargs(hicache_storage_backend="file", hicache_storage_backend_extra_config="[1]")
    with pytest.raises(ValueError, match="mutually exclusive"):
        config_from_kwargs(hicache_storage_backend="file", disable_radix_cache=True)
    with pytest.raises(ValueError, match="tp_size"):
        config_from_kwargs(hicache_storage_backend="file", tp_size=2)
