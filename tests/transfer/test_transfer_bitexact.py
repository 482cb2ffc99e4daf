"""Acceptance 1: pages arrive bit-exact across two OS processes, and decode continues exactly.

Two spawned processes each hold the real stories260K and a real engine pool;
the prefill process runs a real chunked prefill of a real prompt and pushes
its pages over NIXL (UCX) into pages the decode process reserved; the decode
process then continues greedy decoding from the transferred KV. The result
must equal the same computation in one process, token for token.
"""

from __future__ import annotations


import pytest
from conftest import connect_pair
from kv_model import make, page_hashes, pages_for, prefill_chunk, greedy, real_prompt
from kv_peer import PeerSpec

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

NUM_PROMPT = 150
CHUNK = 64
NUM_GEN = 24
CONFIGS = [(d, ps) for d in ("fp8_e4m3", "bf16") for ps in (1, 16, 64)]


@pytest.fixture(scope="module")
def pairs(module_launcher):
    """One prefill and one decode process, each holding one pool (and agent) per configuration."""
    pre, dec = module_launcher.start_multi([PeerSpec("prefill", d, ps, num_pages=256) for d, ps in CONFIGS],
                                           [PeerSpec("decode", d, ps, num_pages=256) for d, ps in CONFIGS])
    return {cfg: (p, d) for cfg, p, d in zip(CONFIGS, pre, dec)}


def reference(kv_dtype: str, page_size: int, ids: list[int], chunk: int, n: int) -> list[int]:
    """Single-process generation: the same chunked prefill and greedy decode in one pool."""
    mp = make(kv_dtype, page_size, 256)
    pages = list(range(1, pages_for(len(ids) + n, page_size) + 1))
    tok = None
    for lo in range(0, len(ids), chunk):
        tok = prefill_chunk(mp, ids, pages, lo, min(lo + chunk, len(ids)))
    return greedy(mp, pages, len(ids), tok, n)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16"])
def test_pages_bit_exact_and_decode_continues(kv_dtype, page_size, pairs, tokenizer):
    ids = real_prompt(tokenizer, NUM_PROMPT)
    pre, dec = pairs[(kv_dtype, page_size)]
    connect_pair(pre, dec)
    zero_page = dec.call("page_hashes", [1])[0]  # decode's pool is untouched: all pages are zero

    ticket = dec.call("expect", "req-bitexact", NUM_PROMPT, pre.agent, 5)  # decode pages start at 6, prefill's at 1
    assert ticket["dst_pages"][0] == 6
    pre.call("start", ticket, ids, CHUNK, False)
    pushes = [pre.call("chunk", ticket["transfer_id"]) for _ in range(0, NUM_PROMPT, CHUNK)]
    events = dec.wait_events(lambda ev: any(e["kind"] in ("completed", "failed") for e in ev), 30)
    done = [e for e in events if e["kind"] == "completed"]
    assert len(done) == 1, events

    # Every page, as prefill had it when it pushed it, is byte-identical on decode.
    pushed_hashes = [h for p in pushes for h in p["hashes"]]
    assert len(pushed_hashes) == len(ticket["dst_pages"]) == pages_for(NUM_PROMPT, page_size)
    assert dec.call("page_hashes", ticket["dst_pages"]) == pushed_hashes
    assert len(set(pushed_hashes)) > 1 and zero_page not in pushed_hashes  # real KV, not zeros
    # No other decode page was written.
    others = [p for p in range(1, 257) if p not in ticket["dst_pages"]]
    assert set(dec.call("page_hashes", others)) == {zero_page}
    # The pushes the receiver saw are the ones prefill issued, in order, covering the pages once.
    assert [(i, p["page_start"], p["num_pages"]) for i, p in enumerate(pushes) if p["num_pages"]] == \
        [(i, s, n) for i, s, n, _, _ in done[0]["pushes"]]

    ref = reference(kv_dtype, page_size, ids, CHUNK, NUM_GEN)
    assert done[0]["meta"]["first_token_id"] == ref[0]
    out = dec.call("generate", ticket["dst_pages"], NUM_PROMPT, done[0]["meta"]["first_token_id"], NUM_GEN)
    assert out == ref
    assert len(set(out)) > 3  # a real continuation, not a stuck token
    dec.call("free", ticket["dst_pages"])
    assert dec.call("state")["free"] == 256 and pre.call("state")["free"] == 256
