"""Bad input under load: the bad-request table (`tests/support/bad_input_cases.py`), plus a 25 MB prompt and
oversized headers, through the router of a real 1P1D cluster while 8 greedy streams run through the same router.

Every case gets a 4xx in the one OpenAI error format within 2 s; every stream completes with the healthy
cluster's text; afterwards every page is free; no stream sees a gap over 1 s between two tokens (issue 12's
bound; measured 0.26, 0.27 and 0.60 s in three runs on the shared 2-core host, `docs/perf/resilience.md`).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from bad_input_cases import CASES, OK, assert_openai_error, send
from cluster_util import stream_pieces, PROMPTS, wait_all_free


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

C = "/v1/completions"
CASE_BOUND = 2.0  # seconds for each bad request's answer
GAP_BOUND = 1.0  # seconds between two tokens of a stream
N_STREAMS, TOKENS = 8, 120

# (id, path, body, status, param, code, extra headers)
EXTRA = [
    ("prompt-25MB", C, {**OK, "prompt": "Once upon a time " * (25 * 1024 * 1024 // 17)}, 400, "prompt",
     "context_length_exceeded", {}),
    ("header-100KB", C, OK, 431, None, "request_header_fields_too_large", {"x-big": "a" * 100_000}),
    ("headers-1000", C, OK, 431, None, "request_header_fields_too_large", {f"x-h{i}": "1" for i in range(1000)}),
]
TABLE = [(*c, {}) for c in CASES] + EXTRA
REQUIRED = {"min_tokens-over-max", "prompt-25MB", "nan", "infinity", "surrogate-prompt", "nested-100000",
            "max_tokens-str", "prompt-int", "empty-prompt", "stop-100", "header-100KB"}


def _body(i: int) -> dict:
    return {"model": "stories260K", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> dict:
    rec = {"i": i, "text": "", "error": None, "done": False, "token_times": []}
    async with client.stream("POST", url + C, json=_body(i)) as resp:
        assert resp.status_code == 200
        async for piece in stream_pieces(resp, rec):
            rec["text"] += piece
            rec["token_times"].append(time.monotonic())
    return rec


def _run_table(url: str, results: list) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        for case_id, path, body, status, param, code, headers in TABLE:
            t = time.monotonic()
            if headers:
                r = c.post(path, json=body, headers=headers)
            else:
                r = send(c, path, body)
            results.append((case_id, time.monotonic() - t, r, status, param, code))


def test_bad_requests_get_openai_4xx_fast_while_streams_stay_exact(pd_1p1d):
    assert REQUIRED <= {c[0] for c in TABLE}
    cluster = pd_1p1d  # shared (tests/support/shared_clusters.py): it only reads, and leaves every page free
    url = cluster.router_url

    async def streams(rounds_until: threading.Event | None) -> list[dict]:
        """N_STREAMS lanes of back-to-back streams: one round, or rounds until the event (at most 20)."""
        async with httpx.AsyncClient(timeout=120) as client:
            async def lane(i: int) -> list[dict]:
                out = [await _stream(client, url, i)]
                while rounds_until is not None and not rounds_until.is_set() and len(out) < 20:
                    out.append(await _stream(client, url, i))
                return out
            return [r for lane_recs in await asyncio.gather(*(lane(i) for i in range(N_STREAMS)))
                    for r in lane_recs]

    reference = {r["i"]: r["text"] for r in asyncio.run(streams(None))}
    assert all(reference.values())

    done = threading.Event()
    results: list = []

    def table() -> None:
        time.sleep(1.0)  # the streams are running
        try:
            _run_table(url, results)
        finally:
            done.set()

    worker = threading.Thread(target=table)
    worker.start()
    got = asyncio.run(streams(done))
    worker.join(timeout=300)
    assert len(results) == len(TABLE)
    slow = []
    for case_id, elapsed, r, status, param, code in results:
        assert_openai_error(r, status, param, code)
        assert 400 <= r.status_code < 500, case_id
        if elapsed >= CASE_BOUND:
            slow.append((case_id, round(elapsed, 2)))
    assert not slow, slow
    gaps = []
    for rec in got:
        assert rec["error"] is None and rec["done"], rec
        assert rec["text"] == reference[rec["i"]], rec["i"]
        gaps += [b - a for a, b in zip(rec["token_times"], rec["token_times"][1:])]
    max_gap = max(gaps)
    print(f"\n{len(results)} bad requests, slowest {max(e for _, e, *_ in results):.3f} s; {len(got)} streams, "
          f"max inter-token gap {max_gap:.3f} s")
    assert max_gap < GAP_BOUND
    loads = wait_all_free(cluster, timeout=30)
    assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
