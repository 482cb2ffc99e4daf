"""Acceptance 5: a restarted peer is detected by its new incarnation; the next transfer succeeds.

A worker restarts on the same URL. Its agent name carries a new incarnation
id, so the peer's cached metadata no longer matches what the next ticket
names: the cache is refreshed (fetched again, the old agent dropped), never
reused, and the transfer after the restart is bit-exact.
"""

from __future__ import annotations

import pytest
from conftest import connect_pair
from kv_peer import PeerCallError, PeerSpec

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

SPEC = dict(kv_cache_dtype="fp8_e4m3", page_size=16, num_pages=64, heartbeat_interval=0.2)


def transfer(pre, dec, tokenizer, request_id, decode_url=None):
    ids = tokenizer(f"{request_id}: Once upon a time, a cat found a tiny boat by the river.").input_ids
    ticket = dec.call("expect", request_id, len(ids), pre.agent)
    pushed = pre.call("start", ticket, ids, len(ids), False, decode_url)
    pre.call("chunk", ticket["transfer_id"])
    events = dec.wait_events(lambda ev: any(e["kind"] in ("completed", "failed") for e in ev), 20)
    assert [e["kind"] for e in events] == ["completed"], events
    assert dec.call("page_hashes", ticket["dst_pages"]) == pre.call("page_hashes", pushed)
    dec.call("free", ticket["dst_pages"])
    return ticket


@pytest.mark.timeout(180)
def test_restarted_decode_is_detected_and_next_transfer_succeeds(launcher, tokenizer):
    pre, dec1 = launcher.start(PeerSpec("prefill", **SPEC), PeerSpec("decode", **SPEC))
    connect_pair(pre, dec1)
    transfer(pre, dec1, tokenizer, "before-restart", dec1.url)
    port = int(dec1.url.rsplit(":", 1)[1])
    dec1.kill()

    (dec2,) = launcher.start(PeerSpec("decode", **SPEC, port=port))
    assert dec2.url == dec1.url and dec2.incarnation != dec1.incarnation and dec2.agent != dec1.agent
    dec2.call("connect", pre.url)
    assert pre.call("state")["restarts_seen"] == 0  # prefill still caches the old incarnation
    transfer(pre, dec2, tokenizer, "after-restart", dec2.url)  # the ticket names the new one
    st = pre.call("state")
    assert st["restarts_seen"] == 1 and st["fetches"] == 2
    assert not pre.call("connected", dec1.agent) and pre.call("connected", dec2.agent)


@pytest.mark.timeout(180)
def test_restarted_prefill_refuses_stale_tickets(launcher, tokenizer):
    pre1, dec = launcher.start(PeerSpec("prefill", **SPEC), PeerSpec("decode", **SPEC))
    connect_pair(pre1, dec)
    transfer(pre1, dec, tokenizer, "before-restart")
    port = int(pre1.url.rsplit(":", 1)[1])
    pre1.kill()

    (pre2,) = launcher.start(PeerSpec("prefill", **SPEC, port=port))
    assert pre2.incarnation != pre1.incarnation
    # Decode still holds the old incarnation: its ticket names it, and the new prefill refuses it.
    ticket = dec.call("expect", "stale", 20, pre1.agent)
    with pytest.raises(PeerCallError) as err:
        pre2.call("start", ticket, list(range(1, 21)), 20, False, dec.url)
    assert err.value.type == "StalePeerError" and pre1.agent in err.value.message
    # Refused: nothing was written, so the pages are free at once (if the liveness probe to the dead
    # old incarnation has not already failed the ticket and released them).
    dec.call("withdraw", ticket["transfer_id"])
    dec.call("events")
    assert dec.call("state")["free"] == 64
    # Decode refreshes its cache (the old incarnation is dropped) and the next transfer succeeds.
    dec.call("invalidate", pre2.url)
    r = dec.call("connect", pre2.url)
    assert r["fetched"] and r["agent"] == pre2.agent and r["superseded"] == [pre1.agent]
    assert not dec.call("connected", pre1.agent)
    transfer(pre2, dec, tokenizer, "after-restart", dec.url)
    assert dec.call("state")["free"] == 64
