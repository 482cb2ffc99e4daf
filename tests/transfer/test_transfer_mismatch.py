"""Acceptance 3: layouts that disagree fail at the handshake, by name, and no page is written.

A prefill worker (stories260K, FP8, page size 16) meets decode workers that
differ in one respect each: page size, KV dtype, KV head count (a model of
the same family with 2 KV heads), and model (same architecture, other
weights), and the drafter state speculative decoding expects across the
transfer (a decode that would wait for the MTP layer's inputs from a prefill
that sends none). Each handshake, in both directions, raises
`LayoutMismatchError` naming the field and both values; decode cannot even
issue a ticket, and its pool stays all zeros. Other speculative settings on
one side only (no state crosses) connect and transfer.
"""

from __future__ import annotations

import pytest
from conftest import connect_pair
from kv_model import write_model_variant
from kv_peer import PeerCallError, PeerSpec

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

BASE = dict(kv_cache_dtype="fp8_e4m3", page_size=16, num_pages=64)


@pytest.fixture(scope="module")
def workers(module_launcher, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    heads2 = write_model_variant(root / "heads2", num_key_value_heads=2)
    same_arch = write_model_variant(root / "same_arch")
    decode_specs = {
        "same": PeerSpec("decode", **BASE),
        "page_size": PeerSpec("decode", **{**BASE, "page_size": 64}),
        "kv_cache_dtype": PeerSpec("decode", **{**BASE, "kv_cache_dtype": "bf16"}),
        "num_kv_heads": PeerSpec("decode", **BASE, model=heads2, load_format="dummy"),
        "model_identity": PeerSpec("decode", **BASE, model=same_arch, load_format="dummy"),
        "draft_state": PeerSpec("decode", **BASE, speculative={"speculative": "NEXTN k=2",
                                                                "draft_state": ["nextn_hidden"]}),
        "speculative_settings": PeerSpec("decode", **BASE, speculative={"speculative": "NGRAM k=4",
                                                                         "draft_state": []}),
    }
    (pre,), decs = module_launcher.start_multi([PeerSpec("prefill", **BASE)], list(decode_specs.values()))
    return pre, dict(zip(decode_specs, decs))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("field, prefill_value, decode_value", [
    ("page_size", 16, 64),
    ("kv_cache_dtype", "'fp8_e4m3'", "'bf16'"),
    ("num_kv_heads", 4, 2),
    ("model_identity", None, None),
    ("draft_state", "'none (speculative off)'", "'nextn_hidden (speculative NEXTN k=2)'"),
])
def test_mismatch_fails_at_handshake_and_writes_nothing(workers, field, prefill_value, decode_value):
    pre, decs = workers
    dec = decs[field]
    zero = dec.call("pool_hash")
    sides = ((dec, pre, decode_value, prefill_value), (pre, dec, prefill_value, decode_value))
    for side, other, local, remote in sides:
        with pytest.raises(PeerCallError) as err:
            side.call("connect", other.url)
        e = err.value
        assert e.type == "LayoutMismatchError", e
        assert field in e.fields
        if local is not None:
            assert f"{field}: local={local} remote={remote}" in e.message
        assert side.agent in e.message and other.agent in e.message
        assert "No KV was transferred" in e.message
    if field == "num_kv_heads":
        assert "model_identity" in e.fields  # another model, too
    else:
        assert e.fields == [field]  # exactly the one difference
    # Nothing was loaded, so no ticket can be made and nothing can be pushed.
    with pytest.raises(PeerCallError) as err:
        dec.call("expect", "req-mismatch", 40, pre.agent)
    assert err.value.type == "PeerNotConnectedError"
    assert dec.call("pool_hash") == zero
    assert set(dec.call("page_hashes", list(range(1, 65)))) == {dec.call("page_hashes", [1])[0]}
    assert dec.call("state")["free"] == 64


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["same", "speculative_settings"])
def test_matching_layouts_connect(workers, tokenizer, which):
    """The control: the same prefill and an identical decode (or one that runs NGRAM while the prefill runs no
    speculation: no drafter state crosses) shake hands and transfer."""
    pre, decs = workers
    dec = decs[which]
    connect_pair(pre, dec)
    ids = tokenizer("Once upon a time, there was a little girl who loved the sea.").input_ids
    ticket = dec.call("expect", "req-ok", len(ids), pre.agent)
    pre.call("start", ticket, ids, 16)
    events = dec.wait_events(lambda ev: any(e["kind"] in ("completed", "failed") for e in ev), 20)
    assert [e["kind"] for e in events] == ["completed"]
