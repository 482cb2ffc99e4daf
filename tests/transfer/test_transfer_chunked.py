"""Acceptance 2: a 2,000-token prompt prefilled in chunks of 256 arrives in 8 pushes, each checked.

The prefill process runs one chunk at a time and pushes it at once; after
each push the test waits for that push's notification on the decode side
and compares exactly the pages it covered. Then decode continues from the
transferred KV and must match the same computation in one process.
"""

from __future__ import annotations

import time

import pytest
from conftest import connect_pair
from kv_model import greedy, make, pages_for, prefill_chunk, real_prompt
from kv_peer import PeerSpec

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

NUM_PROMPT = 2000
CHUNK = 256
PAGE = 16


@pytest.mark.timeout(300)
def test_2000_tokens_arrive_in_8_checked_pushes(launcher, tokenizer):
    ids = real_prompt(tokenizer, NUM_PROMPT)
    pre, dec = launcher.start(PeerSpec("prefill", "fp8_e4m3", PAGE, num_pages=160),
                              PeerSpec("decode", "fp8_e4m3", PAGE, num_pages=160))
    connect_pair(pre, dec)
    ticket = dec.call("expect", "req-2k", NUM_PROMPT, pre.agent, 9)
    tid, dst = ticket["transfer_id"], ticket["dst_pages"]
    assert len(dst) == pages_for(NUM_PROMPT, PAGE) == 125
    pre.call("start", ticket, ids, CHUNK, False)

    events: list[dict] = []
    for k in range(8):
        push = pre.call("chunk", tid)
        assert (push["lo"], push["hi"]) == (k * CHUNK, min((k + 1) * CHUNK, NUM_PROMPT))
        assert push["page_start"] == 16 * k and push["num_pages"] == (16 if k < 7 else 13)
        deadline = time.monotonic() + 10
        while True:  # this push's notification has arrived (it comes after its data)
            arrived = dec.call("progress", tid)  # pushes of the transfer still in progress
            events += dec.call("events")  # the last push completes it: its pushes are in the event
            arrived += [tuple(p) for e in events if e["kind"] == "completed" for p in e["pushes"]]
            if any(p[0] == k for p in arrived) or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        mine = [p for p in arrived if p[0] == k]
        assert mine and mine[0][1:3] == (push["page_start"], push["num_pages"]), arrived
        assert mine[0][4] == (8 if k == 7 else 0)  # only the last push carries the count
        covered = dst[push["page_start"]:push["page_start"] + push["num_pages"]]
        assert dec.call("page_hashes", covered) == push["hashes"]

    done = [e for e in events if e["kind"] == "completed"]
    assert len(done) == 1, events
    assert [p[0] for p in done[0]["pushes"]] == list(range(8))
    assert sum(p[2] for p in done[0]["pushes"]) == 125

    # Decode continues from the transferred KV exactly as one process would.
    ref = make("fp8_e4m3", PAGE, 160)
    pages = list(range(1, 130))
    tok = None
    for lo in range(0, NUM_PROMPT, CHUNK):
        tok = prefill_chunk(ref, ids, pages, lo, min(lo + CHUNK, NUM_PROMPT))
    assert done[0]["meta"]["first_token_id"] == tok
    expect = greedy(ref, pages, NUM_PROMPT, tok, 6)
    assert dec.call("generate", dst, NUM_PROMPT, tok, 6) == expect
    sender_events = pre.wait_events(lambda ev: any(e["kind"] == "completed" for e in ev), 10)
    assert [e["num_pushes"] for e in sender_events if e["kind"] == "completed"] == [8]
    assert pre.call("state")["free"] == 160


@pytest.mark.timeout(300)
def test_a_delta_ticket_gets_only_the_pages_after_the_held_ones(launcher, tokenizer):
    """Decode holds the prompt's first 5 pages: prefill computes all 200 tokens in chunks of 48 and pushes
    only pages 5..12, into the ticket's pages in order; decode's other pages are never written."""
    n, chunk, held = 200, 48, 5
    ids = real_prompt(tokenizer, n)
    pre, dec = launcher.start(PeerSpec("prefill", "fp8_e4m3", PAGE, num_pages=40),
                              PeerSpec("decode", "fp8_e4m3", PAGE, num_pages=40))
    connect_pair(pre, dec)
    zero = dec.call("page_hashes", [1])[0]
    ticket = dec.call("expect", "req-delta", n, pre.agent, 0, held)
    tid, dst = ticket["transfer_id"], ticket["dst_pages"]
    assert ticket["first_page"] == held and len(dst) == pages_for(n, PAGE) - held == 8
    pre.call("start", ticket, ids, chunk, False)
    pushes = [pre.call("chunk", tid) for _ in range(0, n, chunk)]
    # chunk ends 48, 96, 144, 192, 200: full pages 3, 6, 9, 12, then the last (partial) 13th
    assert [(p["page_start"], p["num_pages"]) for p in pushes] == [(5, 0), (5, 1), (6, 3), (9, 3), (12, 1)]
    events = dec.wait_events(lambda ev: any(e["kind"] in ("completed", "failed") for e in ev), 30)
    done = [e for e in events if e["kind"] == "completed"]
    assert len(done) == 1, events
    per_page = done[0]["nbytes"] // 8  # 8 pages moved, not 13
    assert done[0]["nbytes"] == 8 * per_page and "first_token_id" in done[0]["meta"]
    # on decode a push's page_start counts from the ticket's first page
    assert [tuple(p[:4]) for p in done[0]["pushes"]] == [(0, 0, 1, per_page), (1, 1, 3, 3 * per_page),
                                                         (2, 4, 3, 3 * per_page), (3, 7, 1, per_page)]
    assert dec.call("page_hashes", dst) == [h for p in pushes for h in p["hashes"]]
    others = [p for p in range(1, 41) if p not in dst]
    assert dec.call("page_hashes", others) == [zero] * len(others)
