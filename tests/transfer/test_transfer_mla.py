"""MLA latent pages over NIXL: a tiny DeepSeek-V3 (built with transformers) in two OS processes.

The prefill process runs a real chunked prefill and pushes its latent pages (one
latent per token per layer, `kv_format` ``mla``) into pages the decode process
reserved; they arrive byte for byte, and decode's greedy continuation from them
equals the same computation in one process. A decode worker with an MLA pool
and a prefill worker with K/V pages fail at the handshake, naming ``kv_format``.
"""

from __future__ import annotations

import pytest
from conftest import connect_pair
from deepseek_models import build
from kv_model import make, pages_for, prefill_chunk, greedy, real_prompt
from kv_peer import PeerCallError, PeerSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NUM_PROMPT, CHUNK, NUM_GEN = 70, 32, 16
CONFIGS = [("fp8_e4m3", 16), ("fp32", 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3")
    build("deepseek-v3", path)
    return str(path)


@pytest.mark.parametrize("kv_dtype,page_size", CONFIGS)
def test_latent_pages_bit_exact_and_decode_continues(kv_dtype, page_size, module_launcher, model_dir, tokenizer):
    pre, dec = module_launcher.start(PeerSpec("prefill", kv_dtype, page_size, num_pages=128, model=model_dir),
                                     PeerSpec("decode", kv_dtype, page_size, num_pages=128, model=model_dir))
    connect_pair(pre, dec)
    zero_page = dec.call("page_hashes", [1])[0]
    ids = real_prompt(tokenizer, NUM_PROMPT)
    ticket = dec.call("expect", "req-mla", NUM_PROMPT, pre.agent, 3)
    pre.call("start", ticket, ids, CHUNK, False)
    pushes = [pre.call("chunk", ticket["transfer_id"]) for _ in range(0, NUM_PROMPT, CHUNK)]
    events = dec.wait_events(lambda ev: any(e["kind"] in ("completed", "failed") for e in ev), 30)
    done = [e for e in events if e["kind"] == "completed"]
    assert len(done) == 1, events
    pushed = [h for p in pushes for h in p["hashes"]]
    assert len(pushed) == len(ticket["dst_pages"]) == pages_for(NUM_PROMPT, page_size)
    assert dec.call("page_hashes", ticket["dst_pages"]) == pushed
    assert len(set(pushed)) > 1 and zero_page not in pushed
    assert done[0]["nbytes"] == len(pushed) * 2 * page_size * 48 * (1 if kv_dtype == "fp8_e4m3" else 4)

    ref_pool = make(kv_dtype, page_size, 128, model_dir)
    pages = list(range(1, pages_for(NUM_PROMPT + NUM_GEN, page_size) + 1))
    tok = None
    for lo in range(0, NUM_PROMPT, CHUNK):
        tok = prefill_chunk(ref_pool, ids, pages, lo, min(lo + CHUNK, NUM_PROMPT))
    ref = greedy(ref_pool, pages, NUM_PROMPT, tok, NUM_GEN)
    assert done[0]["meta"]["first_token_id"] == ref[0]
    out = dec.call("generate", ticket["dst_pages"], NUM_PROMPT, done[0]["meta"]["first_token_id"], NUM_GEN)
    assert out == ref and len(set(out)) > 3


def test_latent_and_kv_pools_refuse_each_other_by_name(module_launcher, model_dir):
    pre, dec = module_launcher.start(PeerSpec("prefill", "fp8_e4m3", 16, num_pages=64, model=model_dir),
                                     PeerSpec("decode", "fp8_e4m3", 16, num_pages=64))
    zero = dec.call("pool_hash")
    for side, other, local, remote in ((dec, pre, "'mha'", "'mla'"), (pre, dec, "'mla'", "'mha'")):
        with pytest.raises(PeerCallError) as err:
            side.call("connect", other.url)
        assert err.value.type == "LayoutMismatchError"
        assert "kv_format" in err.value.fields and "model_identity" in err.value.fields
        assert f"kv_format: local={local} remote={remote}" in err.value.message
    assert dec.call("pool_hash") == zero
