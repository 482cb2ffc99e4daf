"""Cache-aware prefill routing beats round robin on shared prefixes (fake 2P2D).

Workload: the shipped Mooncake conversation slice, with each ``hash_id`` (a
512-token block in the trace) turned into a fixed ~100-character text block,
so requests that share hash ids share a real text prefix. Every row's prompt
is its blocks concatenated. The chosen prefill of each request is read from
the ``X-PD-Prefill-Url`` the decode workers received.

Reported: for continued conversations (requests sharing more than the
trace-wide first block, a system prompt that cache_aware deliberately
spreads), how often the prefill worker is the one of the previous turn; how
often the chosen worker already had the request's longest shared prefix; and
the share of shared-prefix blocks that landed where they were already cached.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from router_testkit import REPO, FakeWorker, RouterProc

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TRACE = REPO / "bench" / "data" / "mooncake_conversation_1000.jsonl"
WORDS = ("river", "stone", "lamp", "cloud", "paper", "orbit", "maple", "signal", "copper",
         "violet", "harbor", "tiger", "quartz", "meadow", "engine", "falcon")


def block_text(h: int) -> str:
    """A deterministic ~100-character text for Mooncake block ``h``."""
    words = [WORDS[(h * 7 + j * 13 + (h >> j)) % len(WORDS)] for j in range(12)]
    return f"<{h}> " + " ".join(words) + ". "


def load_rows(path: Path) -> list[list[int]]:
    return [json.loads(line)["hash_ids"] for line in path.read_text().splitlines() if line]


async def send_all(url: str, prompts: list[str], tag: str, concurrency: int = 4) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            r = await client.post(url + "/v1/completions", headers={"x-request-id": f"{tag}-{i}"},
                                  json={"model": "stories260K", "prompt": prompts[i],
                                        "max_tokens": 1})
            assert r.status_code == 200, r.text

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def scores(rows: list[list[int]], chosen: list[str], threshold: float) -> dict[str, float]:
    """Where requests that share a prefix went, against where that prefix was before.

    "cached": the chosen worker had already received the request's longest
    shared prefix; over requests whose shared prefix covers ``threshold`` of the
    prompt, and over all requests sharing a block. "previous_turn": for requests
    sharing more than the trace-wide first block (continued conversations), the
    chosen worker is the one of the latest earlier request with that prefix.
    "reusable_blocks_hit": shared-prefix blocks that landed on a worker that
    already had them, over all shared-prefix blocks.
    """
    latest: dict[tuple[int, ...], str] = {}
    seen_on: dict[tuple[int, ...], set[str]] = {}
    n = {"hi": 0, "any": 0, "turn": 0}
    hit = {"hi": 0, "any": 0, "turn": 0}
    reusable = reused = 0
    for blocks, worker in zip(rows, chosen):
        depth = next((d for d in range(len(blocks), 0, -1) if tuple(blocks[:d]) in latest), 0)
        if depth:
            prefix = tuple(blocks[:depth])
            cached = worker in seen_on[prefix]
            n["any"] += 1
            hit["any"] += cached
            if depth / len(blocks) >= threshold:
                n["hi"] += 1
                hit["hi"] += cached
            if depth > 1:
                n["turn"] += 1
                hit["turn"] += worker == latest[prefix]
            reusable += depth
            reused += next((d for d in range(depth, 0, -1)
                            if worker in seen_on[tuple(blocks[:d])]), 0)
        for d in range(1, len(blocks) + 1):
            latest[tuple(blocks[:d])] = worker
            seen_on.setdefault(tuple(blocks[:d]), set()).add(worker)
    return {"requests_above_threshold": n["hi"], "cached_above_threshold": hit["hi"] / n["hi"],
            "requests_sharing_a_block": n["any"], "cached_any_block": hit["any"] / n["any"],
            "continued_conversations": n["turn"], "previous_turn_worker": hit["turn"] / n["turn"],
            "reusable_blocks_hit": reused / reusable}


def test_cache_aware_keeps_shared_prefixes_on_one_prefill_worker():
    rows = load_rows(TRACE)
    prompts = ["".join(block_text(h) for h in blocks) for blocks in rows]
    fast = ["--ttft-ms", "1", "--itl-ms", "1"]
    results = {}
    with FakeWorker("prefill") as p0, FakeWorker("prefill") as p1, \
            FakeWorker("decode", fast) as d0, FakeWorker("decode", fast) as d1:
        for policy in ("cache_aware", "round_robin"):
            with RouterProc(["--prefill", p0.url, p1.url, "--decode", d0.url, d1.url,
                             "--prefill-policy", policy, "--decode-policy", "round_robin",
                             "--cache-threshold", "0.3"]) as router:
                asyncio.run(send_all(router.url, prompts, policy))
                seen = {e["request_id"]: e["headers"]["x-pd-prefill-url"]
                        for d in (d0, d1) for e in d.recent()
                        if e["request_id"].startswith(policy)}
            chosen = [seen[f"{policy}-{i}"] for i in range(len(rows))]
            results[policy] = scores(rows, chosen, 0.3)
            results[policy]["share_on_busier_worker"] = max(
                chosen.count(p0.url), chosen.count(p1.url)) / len(chosen)
    print()
    for policy, s in results.items():
        print(policy, {k: round(v, 3) for k, v in s.items()})
    ca, rr = results["cache_aware"], results["round_robin"]
    assert ca["continued_conversations"] >= 150
    assert ca["previous_turn_worker"] >= 0.8
    assert rr["previous_turn_worker"] <= 0.65  # chance with two workers: 0.5
    assert ca["cached_above_threshold"] >= 0.8
    assert ca["reusable_blocks_hit"] >= 0.8 > rr["reusable_blocks_hit"]
    assert ca["share_on_busier_worker"] <= 0.65  # new prefixes are still spread
