"""The handover step of the GPU first contact (`first_contact`): what disaggregation adds to TTFT, and how much of
that is the KV transfer itself.

Two clusters on the one device, started together: a 1P1D cluster (router, prefill and decode workers, NIXL over
UCX's ``cuda_ipc`` between them) and a colocated one (router and one mixed worker), every worker with
Llama-3.1-8B's shapes (the planner's bundled config, ``--load-format dummy``: seeded random bf16 weights), FP8 KV,
pages of 64, CUDA graphs and the Triton backend (the CUDA defaults). Prompts are random token ids below 512 (the
embedded tokenizer's, which the workers are given) of exactly 2,048 and 8,192 tokens, one prefill chunk each, a
fresh prompt per request (no prefix-cache hit); each request asks for one token (``max_tokens`` 1), so its
latency at the client is its TTFT through the router. After one
warm-up request per length and cluster, `REQUESTS` requests per length go to each cluster, alternating, one at a
time (the clusters never run together).

From the workers' own metrics (``/metrics`` before and after each length's requests, means per request):
the prefill worker's NIXL pushes (``pd:kv_transfer_latency_seconds``: post to completion, per push, summed per
request; ``pd:kv_transfer_bytes``; ``pd:kv_transfer_num_descriptors``), the decode worker's KV wait net of the
prefill's queueing and compute (``pd:request_transfer_time_seconds``), and the prefill compute each role
records (``pd:request_prefill_time_seconds``). Target at 8k: 1P1D TTFT - colocated TTFT - transfer <= 5 ms (the
rest is the handover's overhead: the extra HTTP hop, admission and reservation on the decode worker, the
notification and the decode worker's first step). SGLang's users measured ~200 ms added for ~6 ms of RDMA
(sglang#22853), vLLM's ~197 ms for ~29 ms (RFC #50913).

``--dry-run``: the benchmark's smoke Llama (dummy weights) on CPU, prompts of 256 and 1,024 tokens, two requests.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import httpx
import numpy as np

from pd_cluster.bench import prom
from pd_cluster.bench.scripts import first_contact_pd as pd
from pd_cluster.bench.scripts.first_contact_part import Part, finish, start_part
from pd_cluster.bench.scripts.gpu_common import Row, Section, llama_config

REQUESTS = 4
MODEL = "handover-llama"


def engine_argv(folder, dry: bool) -> list[str]:
    from pd_cluster.engine.assets import DEFAULT_MODEL
    argv = ["--model", str(folder), "--served-model-name", MODEL, "--load-format", "dummy", "--tokenizer",
            DEFAULT_MODEL, "--kv-cache-dtype", "fp8_e4m3", "--page-size", "64"]
    if dry:
        return argv + ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--cpu-threads", "1"]
    return argv + ["--dtype", "bfloat16", "--kv-cache-memory", "4GiB", "--cuda-graph-max-bs", "8"]


def scrape(urls: list[str]) -> list[prom.Scrape]:
    return [prom.parse(httpx.get(u + "/metrics", timeout=10).text) for u in urls]


def one_request(url: str, ids: list[int], timeout_s: float) -> float:
    """Seconds from sending to the whole answer of a one-token completion of prompt `ids` (its TTFT)."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=timeout_s, json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t0


def _mean(before, after, name: str) -> float:
    d = prom.histogram_delta(before, after, name)
    return d.mean if d is not None else float("nan")


def measure(part: Part, pd_c, colo_c, lengths: list[int], vocab: int, requests: int, deadline: float) -> None:
    rng = np.random.default_rng(0)
    prefill = next(p.url for p in pd_c.procs if p.role == "prefill")
    decode = next(p.url for p in pd_c.procs if p.role == "decode")
    mixed = colo_c.procs[0].url
    sec = Section("Handover: TTFT through the router, Llama-3.1-8B shapes (dummy weights), FP8 KV, one device",
                  ["prompt tokens", "colocated TTFT p50 (ms)", "1P1D TTFT p50 (ms)", "difference (ms)",
                   "NIXL pushes (ms)", "rest of the difference (ms)", "decode KV wait (ms)",
                   "prefill compute PD / colocated (ms)", "MiB / request", "descriptors / push"])
    for n in lengths:
        timeout = max(10.0, deadline - time.monotonic())
        for url in (pd_c.router_url, colo_c.router_url):  # warm-up: connections, NIXL handshake, kernel variants
            one_request(url, rng.integers(3, vocab, size=n).tolist(), timeout)
        before = scrape([prefill, decode, mixed])
        ttft = {"pd": [], "colo": []}
        for _ in range(requests):
            for key, url in (("pd", pd_c.router_url), ("colo", colo_c.router_url)):
                ttft[key].append(one_request(url, rng.integers(3, vocab, size=n).tolist(), timeout))
        after = scrape([prefill, decode, mixed])
        (pb, db, mb), (pa, da, ma) = before, after
        pushes = prom.histogram_delta(pb, pa, "pd:kv_transfer_latency_seconds")
        npush = pushes.count if pushes else 0
        push_s = pushes.sum / requests if pushes else float("nan")
        nbytes = prom.delta_sum(pb, pa, "pd:kv_transfer_bytes_total") / requests
        descs = _mean(pb, pa, "pd:kv_transfer_num_descriptors")
        colo, dis = statistics.median(ttft["colo"]) * 1e3, statistics.median(ttft["pd"]) * 1e3
        rest = dis - colo - push_s * 1e3
        sec.rows.append(Row([n, colo, dis, dis - colo, push_s * 1e3, rest,
                             _mean(db, da, "pd:request_transfer_time_seconds") * 1e3,
                             f"{_mean(pb, pa, 'pd:request_prefill_time_seconds') * 1e3:.1f} / "
                             f"{_mean(mb, ma, 'pd:request_prefill_time_seconds') * 1e3:.1f}",
                             nbytes / 2**20, descs]))
        part.info(f"ttft_s_{n}", {k: [round(x, 5) for x in v] for k, v in ttft.items()})
        if n == lengths[-1]:
            part.target("handover", rest, f"{n}-token prompt, {requests} requests, {npush:.0f} pushes",
                        note=f"1P1D {dis:.1f} ms, colocated {colo:.1f} ms, NIXL pushes {push_s * 1e3:.2f} ms "
                             "(no kernel table: the rest is host-side handover work)")
    sec.notes += [f"TTFT = client latency of a max_tokens 1 completion, median of {requests}; NIXL pushes: the "
                  "prefill worker's post-to-completion time per request (pd:kv_transfer_latency_seconds); decode KV "
                  "wait: pd:request_transfer_time_seconds (the KV wait minus the prefill's queueing and compute); "
                  "prefill compute: pd:request_prefill_time_seconds of the prefill and of the mixed worker."]
    part.section(sec)


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "handover", __doc__)
    dry = args.dry_run
    folder = args.work / "handover-model"
    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(dry)
    (folder / "config.json").write_text(json.dumps(config))
    lengths = [2048, 8192] if not dry else [256, 1024]
    deadline = time.monotonic() + max(20.0, part.left_s() - 25)  # keep time to stop the clusters
    clusters = []
    try:
        with part.guard("start the 1P1D and colocated clusters"):
            clusters.append(pd.start(engine_argv(folder, dry), log_level="warning"))
            clusters.append(pd.start(engine_argv(folder, dry), colocated=True, log_level="warning"))
            ready = [pd.wait_ready(c, deadline) for c in clusters]
            part.info("ready_s", {"1P1D": round(ready[0], 1), "colocated": round(ready[1], 1)})
        if len(clusters) == 2 and "ready_s" in part.data["info"]:
            with part.guard("TTFT at 2k and 8k"):
                try:
                    # ids the embedded tokenizer knows (its 512), as in the dry run: the router and workers take
                    # the same path for every prompt; the dummy model's compute does not depend on the ids
                    measure(part, clusters[0], clusters[1], lengths, min(config["vocab_size"], 512),
                            REQUESTS if not dry else 2, deadline)
                except Exception:
                    print("\n".join(pd.tails(c) for c in clusters), flush=True)  # into the run's log
                    raise
    finally:
        pd.stop_all(clusters)
    return finish(part)


if __name__ == "__main__":
    sys.exit(main())
