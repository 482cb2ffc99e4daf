"""Role switching on a real 2P1D cluster (OS processes, real NIXL, real HTTP), shared by the module's tests in order:

1. ``/workers`` gives every worker a stable id (BLAKE2b of its URL), and ``POST /workers/{id}/role`` refuses an
   unknown id (404), a bad role (400) and a switch that would leave no decode worker (409, naming the role), in
   OpenAI's error format.
2. prefill-0 switches to decode under a bounded stream load: no request fails, every text equals the offline greedy
   reference, no worker holds a page afterwards, and prefill-0 then serves decode traffic (the router routes decode
   requests to it, exact); then it switches back to prefill under load, with the same checks. The switch time and
   the requests it delayed are printed (``docs/elastic.md``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from cluster_util import PROMPTS, running_cluster, wait_all_free
from overload_kit import references, stream

from pd_cluster.router.workers import worker_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKENS = 32
LOAD = 30          # requests per load phase
CONCURRENCY = 6    # streams in flight at once
PROMPT_SET = [f"{p} {i}" for i in range(3) for p in PROMPTS]  # 18 prompts: the prefix cache sees repeats and misses


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(2, 1, router_argv=["--decode-policy", "round_robin"]) as c:
        yield c


@pytest.fixture(scope="module")
def refs():
    return references(PROMPT_SET, TOKENS)


def _workers(cluster) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(cluster.router_url + "/workers", timeout=10).json()["workers"]}


def _switch(cluster, wid: str, role: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{cluster.router_url}/workers/{wid}/role", json={"role": role}, timeout=timeout)


def _body(i: int) -> dict:
    return {"model": "stories260K", "prompt": PROMPT_SET[i % len(PROMPT_SET)], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True}


def _load(url: str, n: int, out: list, started: threading.Event) -> None:
    """`n` streams, `CONCURRENCY` at a time (bounded in count and, by the client's timeout, in time)."""
    async def main() -> None:
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> None:
                async with sem:
                    rec = await stream(client, url, _body(i), f"load-{i}")
                    rec["prompt"] = _body(i)["prompt"]
                    out.append(rec)
                    if len(out) >= CONCURRENCY:
                        started.set()
            await asyncio.gather(*(one(i) for i in range(n)))
    asyncio.run(main())


def _switch_under_load(cluster, wid: str, role: str, refs: dict) -> dict:
    """Switch `wid` to `role` while `LOAD` streams run; check them and every worker's pages; return the measures."""
    records: list = []
    started = threading.Event()
    t = threading.Thread(target=_load, args=(cluster.router_url, LOAD, records, started), daemon=True)
    t.start()
    assert started.wait(60), "the load did not start"
    url = next(w["url"] for w in _workers(cluster).values() if w["id"] == wid)
    busy_by = time.monotonic() + 10
    while _workers(cluster)[url]["inflight"] == 0 and time.monotonic() < busy_by:  # switch with work on it
        time.sleep(0.005)
    t0 = time.monotonic()
    r = _switch(cluster, wid, role)
    t1 = time.monotonic()
    t.join(180)
    assert not t.is_alive(), "the load did not end"
    assert r.status_code == 200, r.text
    answer = r.json()
    failed = [x for x in records if x["error"] is not None or not x["done"]]
    assert not failed, failed[:3]
    wrong = [x["rid"] for x in records if x["texts"].get(0) != refs[x["prompt"]]]
    assert not wrong, wrong
    assert len(records) == LOAD
    loads = wait_all_free(cluster, 30)
    for name, load in loads.items():
        assert load["num_free_pages"] == load["num_total_pages"], (name, load)
        assert load["num_running_reqs"] == 0 and load["num_queue_reqs"] == 0, (name, load)
    during = [x for x in records if x["sent"] < t1 and x["ended"] > t0]
    others = [x["ended"] - x["sent"] for x in records if x not in during]
    slowest = max(others, default=0.0)
    delayed = [x for x in during if x["ended"] - x["sent"] > slowest]
    return {"answer": answer, "wall": t1 - t0, "during": len(during), "delayed": len(delayed),
            "slowest_other": slowest, "slowest_during": max((x["ended"] - x["sent"] for x in during), default=0.0)}


def test_ids_and_refusals(cluster):
    workers = _workers(cluster)
    assert {w["id"] for w in workers.values()} == {worker_id(u) for u in workers}
    assert len({w["id"] for w in workers.values()}) == 3
    assert {u: w["id"] for u, w in _workers(cluster).items()} == {u: w["id"] for u, w in workers.items()}
    decode = cluster.by_name("decode-0").url
    r = _switch(cluster, "wnosuchworker", "decode")
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found", r.text
    r = _switch(cluster, workers[decode]["id"], "mixed")
    assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
    r = _switch(cluster, workers[decode]["id"], "prefill")
    err = r.json()["error"]
    assert r.status_code == 409 and err["code"] == "would_leave_no_worker" and "no decode worker" in err["message"]
    assert err["type"] and err["param"] == "role"
    r = _switch(cluster, workers[decode]["id"], "decode")  # already decode: nothing to do
    assert r.status_code == 200 and r.json()["switched"] is False


def test_prefill_switches_to_decode_and_back_under_load(cluster, refs):
    p0 = cluster.by_name("prefill-0").url
    wid = _workers(cluster)[p0]["id"]

    there = _switch_under_load(cluster, wid, "decode", refs)
    entry = _workers(cluster)[p0]
    assert entry["id"] == wid and entry["role"] == "decode" and entry["healthy"], entry
    assert httpx.get(p0 + "/server_info", timeout=5).json()["role"] == "decode"

    # it serves decode traffic: the round-robin decode policy sends it half of these, and each is exact
    with httpx.Client(timeout=60) as c:
        for i in range(6):
            r = c.post(cluster.router_url + "/v1/completions", json=_body(i))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == refs[_body(i)["prompt"]], r.text
    chosen = [line for line in httpx.get(cluster.router_url + "/metrics", timeout=10).text.splitlines()
              if line.startswith("pd_router_worker_requests_total") and 'role="decode"' in line and p0 in line]
    assert chosen and float(chosen[0].split()[-1]) >= 3, chosen
    # now only prefill-1 is left as prefill: switching it away is refused
    p1 = cluster.by_name("prefill-1").url
    r = _switch(cluster, _workers(cluster)[p1]["id"], "decode")
    assert r.status_code == 409 and "no prefill worker" in r.json()["error"]["message"], r.text

    back = _switch_under_load(cluster, wid, "prefill", refs)
    entry = _workers(cluster)[p0]
    assert entry["id"] == wid and entry["role"] == "prefill" and entry["healthy"], entry
    assert httpx.get(p0 + "/server_info", timeout=5).json()["role"] == "prefill"
    metrics = httpx.get(cluster.router_url + "/metrics", timeout=10).text
    ok = [line for line in metrics.splitlines()
          if line.startswith("pd_router_role_switches_total") and 'outcome="ok"' in line]
    assert sum(float(line.split()[-1]) for line in ok) == 2, ok
    own = httpx.get(p0 + "/metrics", timeout=10).text  # the worker's own count, kept across its role apps
    for a, b in (("prefill", "decode"), ("decode", "prefill")):
        assert any(line.startswith("pd:role_switches_total{") and f'from_role="{a}"' in line
                   and f'to_role="{b}"' in line and line.endswith(" 1.0") for line in own.splitlines()), own[-2000:]

    for name, m in (("prefill -> decode", there), ("decode -> prefill", back)):
        w = m["answer"]["worker"]
        print(f"\nrole switch {name}: {m['answer']['switch_secs']:.3f} s at the router "
              f"(its own requests off the worker {m['answer']['router_drain_secs']:.3f} s; worker: drain "
              f"{w['drain_secs']:.3f} s, teardown {w['teardown_secs']:.3f} s, set-up {w['setup_secs']:.3f} s); "
              f"{m['during']} of {LOAD} requests overlapped it, {m['delayed']} took longer than the slowest "
              f"other one ({m['slowest_during']:.2f} s against {m['slowest_other']:.2f} s)")
