"""Fault: kill -9 of one DP rank of a data-parallel-attention decode instance with 20 streams in flight.

`pd-serve` 1P2D, both decode workers at ``--tp-size 2 --dp-size 2 --enable-dp-attention --enable-expert-parallel``
(a tiny DeepSeek-V3 built by transformers, fp32 latents). Twenty greedy streams run through the router; once each
has relayed 3 pieces and DP rank 1 of the decode-0 instance has requests of its own, that rank's process gets
SIGKILL (their text is first checked against transformers' greedy tokens, unstreamed). Rank 0 then ends the whole instance (its ranks step in lockstep: `decode/dp_instance.py`), its streams
break, and the router migrates them to decode-1. Every stream must end with the text of the undisturbed run, the
instance must come back whole (new rank processes, a request pinned to rank 1 exact), and no page may stay held on
any rank of either instance or on the prefill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from cluster_util import running_pd_serve, stream_pieces
from deepseek_models import PROMPTS, build, hf_greedy_recompute, prompt_ids
from test_dp_attention_pd import DP_DECODE, ENGINE, _idle_loads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N_STREAMS = 20
TOKENS = 160  # long enough that decode-0's streams are still running when its rank dies


def _prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]  # five prompts, four streams each


def _reference(url: str, model: str) -> list[dict]:
    """Each prompt's greedy completion through the router, unstreamed, with its token ids."""
    with httpx.Client(timeout=300) as client:
        return [client.post(url + "/v1/completions", json={
            "model": model, "prompt": _prompt(i), "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()["choices"][0] for i in range(len(PROMPTS))]


async def _stream(client: httpx.AsyncClient, url: str, model: str, i: int, progress: list[int]) -> dict:
    body = {"model": model, "prompt": _prompt(i), "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    rec = {"i": i, "text": "", "error": None, "done": False}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for piece in stream_pieces(resp, rec):
            rec["text"] += piece
            progress[i] += 1
    return rec


def _rank1(decode_url: str) -> tuple[str, int]:
    """DP rank 1's URL and process id, from the instance's /server_info and the rank's own."""
    rank_url = httpx.get(decode_url + "/server_info", timeout=10).json()["dp_urls"][1]
    return rank_url, httpx.get(rank_url + "/server_info", timeout=10).json()["pid"]


def _rank1_busy(decode_url: str) -> bool:
    ranks = httpx.get(decode_url + "/get_load", timeout=5).json()["dp_ranks"]
    return ranks[1]["in_flight"] > 0


async def _run(url: str, model: str, decode0: str | None) -> tuple[list[dict], bool]:
    """The streams; with `decode0`, its DP rank 1 is killed once every stream has 3 pieces and that rank runs
    some (not if a stream ended first)."""
    progress = [0] * N_STREAMS
    killed = False
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.ensure_future(_stream(client, url, model, i, progress)) for i in range(N_STREAMS)]
        deadline = time.monotonic() + 120
        while decode0 and not any(t.done() for t in tasks) and time.monotonic() < deadline:
            if min(progress) >= 3 and await asyncio.to_thread(_rank1_busy, decode0):
                os.kill((await asyncio.to_thread(_rank1, decode0))[1], signal.SIGKILL)
                killed = True
                break
            await asyncio.sleep(0.02)
        return await asyncio.gather(*tasks), killed


def test_kill_9_of_a_dp_rank_migrates_every_stream_exactly_and_the_instance_comes_back(tmp_path):
    model = tmp_path / "deepseek-v3-tiny"
    hf = build("deepseek-v3", model)
    expected = [hf_greedy_recompute(hf, prompt_ids(p), TOKENS) for p in PROMPTS]
    argv = ["--model", str(model), *ENGINE, *DP_DECODE, "--num-decode", "2",
            "--router-arg=--decode-policy=round_robin"]
    with running_pd_serve(tmp_path / "manifest.json", argv, timeout=400) as (url, m):
        decodes = sorted(w["url"] for w in m["workers"] if w["role"] == "decode")
        prefill = next(w["url"] for w in m["workers"] if w["role"] == "prefill")
        reference = _reference(url, model.name)  # transformers' tokens; their text is what every stream must show
        assert [r["token_ids"] for r in reference] == expected
        before = _rank1(decodes[0])
        for _ in range(3):  # a round that missed the window is exact too, and is sent again
            got, killed = asyncio.run(_run(url, model.name, decodes[0]))
            if killed:
                break
            assert [r["text"] for r in got] == [reference[i % len(PROMPTS)]["text"] for i in range(N_STREAMS)]
        assert killed, "3 rounds ended before every stream had 3 pieces with DP rank 1 of decode-0 busy"
        for rec in got:
            assert rec["error"] is None and rec["done"], rec
            assert rec["text"] == reference[rec["i"] % len(PROMPTS)]["text"], rec["i"]
        router_metrics = httpx.get(url + "/metrics", timeout=10).text
        assert sum(float(line.split()[-1]) for line in router_metrics.splitlines()
                   if line.startswith("pd_router_migrations_total")) >= 1
        # the instance comes back whole: new rank processes, and rank 1 answers exactly again
        deadline, after = time.monotonic() + 240, None
        while after is None and time.monotonic() < deadline:
            try:
                if httpx.get(decodes[0] + "/health", timeout=5).status_code == 200:
                    after = _rank1(decodes[0])
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert after is not None and after[1] != before[1], (before, after)
        sent = httpx.get(decodes[0] + "/get_load", timeout=5).json()["dp_ranks"][1]["dispatched"]
        for i in range(2):  # round robin over the two decodes: one of these lands on decode-0's new rank 1
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model.name, "prompt": _prompt(i), "max_tokens": TOKENS,
                "temperature": 0, "ignore_eos": True, "data_parallel_rank": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[i]["text"], r.text
        assert httpx.get(decodes[0] + "/get_load", timeout=5).json()["dp_ranks"][1]["dispatched"] == sent + 1
        loads = _idle_loads({"prefill": prefill, "decode-0": decodes[0], "decode-1": decodes[1]}, 30)
        for name, load in loads.items():
            assert load["num_free_pages"] == load["num_total_pages"], (name, load)
            for rank in load.get("dp_ranks", []):
                assert rank["num_free_pages"] == rank["num_total_pages"], (name, rank)
