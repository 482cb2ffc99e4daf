"""The same transfer with both pools in GPU memory (VRAM), through the same code as host memory.

Two processes on one GPU: NIXL registers the VRAM pools and UCX moves the
pages GPU to GPU (cuda_ipc within a node). The prefill process posts each
push only once a CUDA event recorded after the chunk's forward pass is
complete. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
from conftest import connect_pair
from kv_model import greedy, make, pages_for, prefill_chunk, real_prompt
from kv_peer import PeerSpec

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

NUM_PROMPT, CHUNK, NUM_GEN = 300, 128, 16


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16"])
def test_vram_pages_bit_exact_and_decode_continues(kv_dtype, launcher, tokenizer):
    ids = real_prompt(tokenizer, NUM_PROMPT)
    pre, dec = launcher.start(PeerSpec("prefill", kv_dtype, 16, num_pages=128, device="cuda:0"),
                              PeerSpec("decode", kv_dtype, 16, num_pages=128, device="cuda:0"))
    assert pre.hello["mem_type"] == dec.hello["mem_type"] == "VRAM"
    connect_pair(pre, dec)
    ticket = dec.call("expect", "req-vram", NUM_PROMPT, pre.agent, 4)
    pre.call("start", ticket, ids, CHUNK, False)
    pushes = [pre.call("chunk", ticket["transfer_id"]) for _ in range(0, NUM_PROMPT, CHUNK)]
    events = dec.wait_events(lambda ev: any(e["kind"] in ("completed", "failed") for e in ev), 60)
    done = [e for e in events if e["kind"] == "completed"]
    assert len(done) == 1, events
    assert dec.call("page_hashes", ticket["dst_pages"]) == [h for p in pushes for h in p["hashes"]]

    ref = make(kv_dtype, 16, 128, device="cuda:0")
    pages = list(range(1, pages_for(NUM_PROMPT + NUM_GEN, 16) + 1))
    tok = None
    for lo in range(0, NUM_PROMPT, CHUNK):
        tok = prefill_chunk(ref, ids, pages, lo, min(lo + CHUNK, NUM_PROMPT))
    assert done[0]["meta"]["first_token_id"] == tok
    assert dec.call("generate", ticket["dst_pages"], NUM_PROMPT, tok, NUM_GEN) == greedy(ref, pages, NUM_PROMPT,
                                                                                         tok, NUM_GEN)
