"""The handshake's speculative-decoding check (`pd_cluster.transfer.layout`): the drafter state that crosses the
transfer (``draft_state``) must be the same on both sides, or the pair is refused at the handshake naming both
sides' settings; settings that differ while no state crosses are compatible and named in one log line; a peer
that names none (an older version) runs and sends none. No NIXL agent: `AgentInfo` payloads only."""

from __future__ import annotations

import dataclasses

import pytest
from agent_infos import info

from pd_cluster.engine.spec.config import SpeculativeConfig
from pd_cluster.transfer.errors import LayoutMismatchError
from pd_cluster.transfer.layout import AgentInfo, check_compatible, speculative_difference

NEXTN = SpeculativeConfig(speculative_algorithm="NEXTN", speculative_num_steps=2).handshake()
OFF = SpeculativeConfig().handshake()


def _with(spec: dict, name: str) -> AgentInfo:
    return dataclasses.replace(info(name), speculative=spec)


def test_every_algorithm_sends_no_drafter_state_so_settings_never_conflict():
    for algo in ("NGRAM", "NEXTN"):
        assert SpeculativeConfig(speculative_algorithm=algo).handshake()["draft_state"] == []
    assert OFF == {"speculative": "off", "draft_state": []}
    assert NEXTN["speculative"].startswith("NEXTN k=2")
    prefill, decode = _with(OFF, "prefill-h-1-tp0-p"), _with(NEXTN, "decode-h-2-tp0-d")
    assert check_compatible(prefill, decode) == [] and check_compatible(decode, prefill) == []
    line = speculative_difference(decode, prefill)
    assert "decode-h-2-tp0-d (NEXTN k=2" in line and "prefill-h-1-tp0-p (off)" in line
    assert speculative_difference(decode, _with(NEXTN, "decode-h-3-tp0-e")) is None


def test_different_drafter_state_is_refused_naming_both_sides():
    """A peer whose decode expects the MTP layer's inputs from the prefill (a version that sends them) against
    one that sends none: refused in both directions, before any transfer."""
    newer = {"speculative": "NEXTN k=2", "draft_state": ["nextn_hidden"]}
    mine, theirs = _with(OFF, "prefill-h-1-tp0-p"), _with(newer, "decode-h-2-tp0-d")
    for local, remote, lv, rv in ((mine, theirs, "none (speculative off)", "nextn_hidden (speculative NEXTN k=2)"),
                                  (theirs, mine, "nextn_hidden (speculative NEXTN k=2)", "none (speculative off)")):
        with pytest.raises(LayoutMismatchError) as e:
            check_compatible(local, remote)
        assert e.value.fields == ["draft_state"]
        msg = str(e.value)
        assert f"draft_state: local={lv!r} remote={rv!r} (fatal)" in msg
        assert local.agent_name in msg and remote.agent_name in msg and "No KV was transferred" in msg
    assert speculative_difference(mine, theirs) is None  # refused, not merely logged


def test_the_payload_round_trips_and_an_older_peer_runs_none():
    decode = _with(NEXTN, "decode-h-2-tp0-d")
    again = AgentInfo.from_dict(decode.to_dict())
    assert again.speculative == NEXTN and check_compatible(decode, again) == []
    older = info("prefill-h-1-tp0-p").to_dict()
    assert "speculative" not in older
    parsed = AgentInfo.from_dict(older)
    assert parsed.speculative == {} and parsed == info("prefill-h-1-tp0-p")
    assert check_compatible(decode, parsed) == []
    with pytest.raises(ValueError, match="speculative must be an object with a draft_state list"):
        AgentInfo.from_dict({**older, "speculative": {"draft_state": "nextn_hidden"}})
