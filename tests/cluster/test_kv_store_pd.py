"""The cluster-wide KV store (Mooncake Store) on a real 2P2D cluster of OS processes.

One cluster for the module: 2 prefill + 2 decode workers with ``--hicache-storage-backend mooncake`` and no
master given, so the cluster starts one (``kv-master``) and a process lending the store its memory (``kv-store``),
both on loopback; the router sends prefills round robin, so a prefix computed on one prefill worker is met on
the other, which can only get it from the store.

- Exact: 200 greedy prompts (20 families sharing 3-page prefixes) give the texts of the engine with every cache
  off, and the store served pages to both roles.
- Restart: a prefill worker killed and started again serves the prefixes computed before from the store.
- Corruption: a page flipped in the store is refused by whoever reads it (checksum) and recomputed: 0 wrong texts.
- Another model: an engine of other weights (same layout) on the same store reads none of its pages.
- Master killed mid-run: 0 failed requests; the workers report the store unavailable, and use it again once the
  master is back (they write pages anew).
- Start-up: ``pd-worker`` with an unreachable master and ``--hicache-storage-required`` exits with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from cluster_util import FAST_ENGINE, running_cluster

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.kv.l3.keys import prefix_digests
from pd_cluster.launch.cluster import free_port

pytestmark = pytest.mark.slow

PAGE = 16
MAX_TOKENS = 8
# a long prefetch wait: a loaded 2-core machine may take seconds for a new client's first read, and these tests
# count hits (the wait's effect on TTFT is the benchmark's business)
STORE_ARGS = ["--page-size", str(PAGE), "--hicache-storage-backend", "mooncake",
              "--hicache-storage-backend-extra-config", json.dumps({"prefetch_timeout": 10})]
ENGINE = [*FAST_ENGINE, *STORE_ARGS]


def family_prompts(families: int, per_family: int, seed: int) -> list[list[int]]:
    """`families` x `per_family` token-id prompts: 3 shared pages, then a distinct tail of 5 to 20 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(families):
        head = rng.integers(3, 500, size=3 * PAGE).tolist()
        for _ in range(per_family):
            out.append(head + rng.integers(3, 500, size=int(rng.integers(5, 21))).tolist())
    return out


def reference(prompts: list[list[int]], **kw) -> list[str]:
    llm = LLM(page_size=PAGE, disable_radix_cache=True, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.text for o in outs]


def complete(url: str, prompts: list[list[int]], concurrency: int = 4) -> list[str | None]:
    """Each prompt's text through the router (None: the request failed); bounded in count and time."""
    def one(prompt):
        try:
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "stories260K", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            return r.json()["choices"][0]["text"] if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def metrics(url: str) -> dict[str, float]:
    """The worker's ``pd:cached_tokens`` by source, and its store counters."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pd:cached_tokens_total{"):
            out[line.split('cache_source="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith("pd:kv_store_") or line.startswith("pd:backuped_tokens_total"):
            out[line.split("{")[0].split(" ")[0]] = float(line.split()[-1])
    return out


def wait_for(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(2, 2, engine_argv=STORE_ARGS, router_argv=["--prefill-policy", "round_robin"],
                         kv_store_size="128MiB") as c:
        yield c


def workers(cluster, role=None):
    return [p for p in cluster.procs if role is None or p.role == role]


def test_texts_equal_every_cache_off_and_the_store_serves_both_roles(cluster):
    assert cluster.kv_store is not None and {p.name for p in cluster.services} == {"kv-master", "kv-store"}
    prompts = family_prompts(20, 10, seed=1)
    got = complete(cluster.router_url, prompts)
    assert got == reference(prompts)
    by_role = {role: [metrics(p.url) for p in workers(cluster, role)] for role in ("prefill", "decode")}
    assert sum(m["storage"] for m in by_role["prefill"]) > 0  # a family's head met on the other prefill worker
    assert sum(m["storage"] for m in by_role["decode"]) > 0
    assert all(m["pd:kv_store_available"] == 1 and m["pd:kv_store_corrupt_pages_total"] == 0
               for ms in by_role.values() for m in ms)


def test_a_restarted_prefill_serves_its_earlier_prefixes_from_the_store(cluster):
    prompts = family_prompts(4, 2, seed=2)
    assert complete(cluster.router_url, prompts, 1) == reference(prompts)
    cluster.kill("prefill-0")
    proc = cluster.by_name("prefill-0")
    # pd-serve's supervision step: restart it, and register it with the router again once it answers
    assert wait_for(lambda: cluster.tend() is not None and proc.restarts.total >= 1 and proc.alive()
                    and not proc.restarts.awaiting_health, 180)
    url = proc.url
    cluster.wait_ready(timeout=120)
    again = [p[:3 * PAGE] + [7, 8, 9, 10, 11] for p in prompts[::2]]  # the same heads, new tails
    assert complete(cluster.router_url, again, 1) == reference(again)
    m = metrics(url)  # a new process: its counters start at 0; the heads are of different families
    assert m["storage"] >= 3 * PAGE and m["device"] == 0, m


def _client(cluster):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.kv_store.address) == 0
    return store


def test_a_page_corrupted_in_the_store_is_recomputed(cluster):
    prompts = family_prompts(1, 2, seed=3)
    info = httpx.get(workers(cluster, "prefill")[0].url + "/server_info", timeout=10).json()
    prefix = info["kv_store"]["key_prefix"]
    assert complete(cluster.router_url, prompts[:1], 1) == reference(prompts[:1])
    time.sleep(0.5)  # the writes are asynchronous
    store = _client(cluster)
    keys = [f"{prefix}{d:032x}" for d in prefix_digests(prompts[0], PAGE, 3)]
    assert all(c == 1 for c in store.batch_is_exist(keys))
    for key in keys:
        value = bytearray(store.get(key))
        value[len(value) // 2] ^= 0x10  # one bit of KV
        assert store.remove(key, True) == 0 and store.put(key, bytes(value)) == 0
    before = sum(metrics(p.url)["pd:kv_store_corrupt_pages_total"] for p in workers(cluster))
    # the other prefill worker, and a decode worker, meet the head in the store only
    assert complete(cluster.router_url, prompts[1:] * 3, 1) == reference(prompts[1:] * 3)
    after = sum(metrics(p.url)["pd:kv_store_corrupt_pages_total"] for p in workers(cluster))
    assert after > before
    store.close()


def test_an_engine_of_another_model_reads_none_of_the_stores_pages(cluster):
    prompts = family_prompts(3, 2, seed=1)  # heads the cluster stored in the first test
    extra = json.dumps({"master_server_address": cluster.kv_store.address, "local_hostname": "127.0.0.1"})
    other = LLM(page_size=PAGE, load_format="dummy", seed=7, hicache_storage_backend="mooncake",
                hicache_storage_backend_extra_config=extra, hicache_storage_required=True)
    outs = other.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.text for o in outs] == reference(prompts, load_format="dummy", seed=7)
    st = other.engine.l3.stats
    assert st.lookup_pages > 0 and st.hit_pages == 0 and st.corrupt_pages == 0
    other.engine.close()


def test_master_killed_mid_run_fails_nothing_and_the_store_comes_back(cluster):
    prompts = family_prompts(10, 4, seed=4)
    expected = reference(prompts)
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(complete, cluster.router_url, prompts, 2)
        time.sleep(1.0)
        cluster.kill("kv-master")
        got = run.result(timeout=300)
    assert got == expected  # none failed, none wrong
    assert wait_for(lambda: all(metrics(p.url)["pd:kv_store_available"] == 0 for p in workers(cluster)), 30)
    cluster.restart("kv-master")
    assert wait_for(lambda: all(metrics(p.url)["pd:kv_store_available"] == 1 for p in workers(cluster)), 60)
    # a restarted master starts empty and holds memory again once the kv-store process's client has mounted its
    # segment anew (Mooncake's heartbeat does that): until then a write finds no space and is dropped
    store = _client(cluster)
    assert wait_for(lambda: store.put(f"probe-{time.monotonic()}", b"x" * 1024) == 0, 60)
    store.close()
    written = sum(metrics(p.url)["pd:backuped_tokens_total"] for p in workers(cluster, "prefill"))
    fresh = family_prompts(2, 2, seed=5)
    assert complete(cluster.router_url, fresh, 1) == reference(fresh)
    assert wait_for(lambda: sum(metrics(p.url)["pd:backuped_tokens_total"]
                                for p in workers(cluster, "prefill")) > written, 30)


def test_pd_worker_refuses_to_start_on_an_unreachable_required_store():
    extra = json.dumps({"master_server_address": f"127.0.0.1:{free_port()}"})
    proc = subprocess.run([sys.executable, "-m", "pd_cluster.launch.worker", "--role", "prefill", "--port",
                           str(free_port()), *ENGINE[:-2], "--hicache-storage-backend-extra-config", extra,
                           "--hicache-storage-required"], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "cannot connect to the Mooncake master" in proc.stdout + proc.stderr
