"""Shared pieces of the overload tests on real clusters: offline references, concurrent streams, router counts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from pd_cluster.engine.llm import LLM
from pd_cluster.engine.sampling.params import SamplingParams

MODEL = "stories260K"


def references(prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Offline greedy text of each prompt (the embedded model, prefix cache off): what every stream must equal."""
    llm = LLM(kv_cache_memory="64MiB", disable_radix_cache=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return {p: o.outputs[0].text for p, o in zip(prompts, outs)}


async def stream(client: httpx.AsyncClient, url: str, body: dict, rid: str, progress: dict | None = None) -> dict:
    """One streamed completion: each choice's text by index, the error event or status if any, [DONE] seen."""
    rec: dict = {"rid": rid, "texts": {}, "error": None, "done": False, "sent": time.monotonic()}
    try:
        async with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True),
                                 headers={"x-request-id": rid}) as resp:
            if resp.status_code != 200:
                rec["error"] = {"status": resp.status_code, "body": (await resp.aread())[:300].decode()}
                return rec
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    rec["done"] = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["error"] = event["error"]
                        continue
                    for c in event["choices"]:
                        rec["texts"][c["index"]] = rec["texts"].get(c["index"], "") + c["text"]
                        if progress is not None and c["text"]:
                            progress[rid] = progress.get(rid, 0) + 1
    except httpx.HTTPError as e:
        rec["error"] = {"exception": repr(e)}
    rec["ended"] = time.monotonic()
    return rec


def burst(url: str, bodies: dict[str, dict], timeout: float = 300) -> dict[str, dict]:
    """Every body at once, one stream each; the records by request id."""
    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            return await asyncio.gather(*(stream(client, url, b, rid) for rid, b in bodies.items()))
    return {r["rid"]: r for r in asyncio.run(main())}


def router_counts(url: str) -> dict[str, float]:
    """What the overload checks count, from the router's metrics: breakers opened, workers found dead, attempts
    failed in flight by health, migrations, retries and failed attempts (sums over labels)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    names = {"breakers_opened": ('pd_router_cb_state_transitions_total', 'to_state="open"'),
             "deaths": ("pd_router_worker_deaths_total", ""), "inflight_failed": (
                 "pd_router_inflight_failed_by_health_total", ""),
             "migrations": ("pd_router_migrations_total", ""), "retries": ("pd_router_retries_total", ""),
             "failed_attempts": ("pd_router_upstream_failures_total", "")}
    out = {}
    for key, (name, label) in names.items():
        out[key] = sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith(name) and label in line)
    return out
