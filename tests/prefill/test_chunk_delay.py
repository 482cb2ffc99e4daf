"""The prefill worker's fault-injection knob (`PD_FAULT_PREFILL_CHUNK_DELAY`): parsed strictly, off by default."""

from __future__ import annotations

import pytest

from pd_cluster.prefill.jobs import FAULT_CHUNK_DELAY_ENV, ChunkDelay


def test_unset_or_empty_is_off():
    assert ChunkDelay.from_env({}) is None
    assert ChunkDelay.from_env({FAULT_CHUNK_DELAY_ENV: ""}) is None


def test_seconds_and_an_optional_request_id_marker():
    every = ChunkDelay.from_env({FAULT_CHUNK_DELAY_ENV: "2.5"})
    assert every == ChunkDelay(2.5, "") and every.applies(["any-request"])
    marked = ChunkDelay.from_env({FAULT_CHUNK_DELAY_ENV: "0.25:slowchunk"})
    assert marked == ChunkDelay(0.25, "slowchunk")
    assert marked.applies(["a", "x-slowchunk-1"]) and not marked.applies(["a", "b"]) and not marked.applies([])


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf", ":slow"])
def test_a_malformed_value_is_refused_by_name(raw):
    with pytest.raises(ValueError, match=FAULT_CHUNK_DELAY_ENV):
        ChunkDelay.from_env({FAULT_CHUNK_DELAY_ENV: raw})
