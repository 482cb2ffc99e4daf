"""Which prefill rank sends which KV heads to which decode rank when the TP sizes differ (`transfer.tp_plan`), the
byte ranges that moves, and the handshake's refusal of what it cannot convert."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pd_cluster.transfer.errors import LayoutMismatchError
from pd_cluster.transfer.layout import check_compatible, compare
from pd_cluster.transfer.tp_plan import HeadSlice, PageGeometry, Part, describe, plan_parts, rank_heads, slice_descs
from agent_infos import info


def test_heads_split_and_merge():
    assert plan_parts("mha", 4, 2, 1) == (Part(0, 0, (HeadSlice(0, 0, 2),)), Part(1, 0, (HeadSlice(0, 2, 2),)))
    assert plan_parts("mha", 4, 1, 2) == (Part(0, 0, (HeadSlice(0, 0, 2),)), Part(0, 1, (HeadSlice(2, 0, 2),)))
    assert plan_parts("mha", 8, 2, 4) == (Part(0, 0, (HeadSlice(0, 0, 2),)), Part(0, 1, (HeadSlice(2, 0, 2),)),
                                          Part(1, 2, (HeadSlice(0, 0, 2),)), Part(1, 3, (HeadSlice(2, 0, 2),)))
    assert plan_parts("mha", 4, 2, 2) == (Part(0, 0), Part(1, 1))  # same size: whole pages, rank r to rank r


def test_replicated_heads_are_sent_once_spreading_the_replicas():
    assert rank_heads(2, 4, 1) == (0,) and rank_heads(2, 4, 2) == (1,)
    # P TP 4 over 2 heads (each on two ranks) -> D TP 1: one replica of each, from different ranks
    assert plan_parts("mha", 2, 4, 1) == (Part(0, 0, (HeadSlice(0, 0, 1),)), Part(2, 0, (HeadSlice(0, 1, 1),)))
    # P TP 1 -> D TP 4: ranks 0 and 1 both hold head 0
    assert plan_parts("mha", 2, 1, 4) == tuple(Part(0, d, (HeadSlice(d // 2, 0, 1),)) for d in range(4))
    # replicas on both sides: decode rank d takes its head from the replica of index d % 2
    assert [(p.prefill_rank, p.decode_rank) for p in plan_parts("mha", 2, 4, 4)] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_mla_latent_once_per_decode_rank_and_no_pair_twice():
    assert plan_parts("mla", 1, 2, 1) == (Part(0, 0),)
    assert plan_parts("mla", 1, 1, 2) == (Part(0, 0), Part(0, 1))
    parts = plan_parts("mla", 1, 2, 4)
    assert parts == (Part(0, 0), Part(1, 1), Part(0, 2), Part(1, 3))
    assert len({(p.prefill_rank, p.decode_rank) for p in parts}) == len(parts) == 4


@pytest.mark.parametrize("heads, p_tp, d_tp", [(h, p, d) for h in (1, 2, 4, 8) for p, d in
                                                itertools.product((1, 2, 4, 8), repeat=2)
                                                if (max(p, h) % min(p, h) == 0 and max(d, h) % min(d, h) == 0)])
def test_bytes_land_on_exactly_the_decode_ranks_heads(heads, p_tp, d_tp):
    """Move real bytes with the descriptors: every decode rank's pages end with its own heads' K and V, every
    head's bytes written exactly once."""
    layers, page_size, dim, num_pages = 3, 4, 2, 3

    def geometry(tp: int) -> PageGeometry:
        return PageGeometry.of({"num_layers": layers, "num_kv_heads": len(rank_heads(heads, tp, 0)),
                                "page_size": page_size, "head_dim": dim, "kv_cache_dtype": "fp32",
                                "page_nbytes": layers * 2 * len(rank_heads(heads, tp, 0)) * page_size * dim * 4})

    def pool(tp: int, rank: int, fill: bool) -> np.ndarray:
        shape = (num_pages + 1, layers, 2, len(rank_heads(heads, tp, rank)), page_size, dim)
        if not fill:
            return np.full(shape, -1.0, dtype=np.float32)
        vals = np.empty(shape, dtype=np.float32)
        for j, h in enumerate(rank_heads(heads, tp, rank)):  # value = (page, layer, plane, global head, token, d)
            idx = np.indices(shape[:3] + shape[4:])
            vals[:, :, :, j] = (idx[0] * 1e5 + idx[1] * 1e4 + idx[2] * 1e3 + h * 100 + idx[3] * 10 + idx[4])
        return vals

    src = [pool(p_tp, r, True) for r in range(p_tp)]
    dst = [pool(d_tp, r, False) for r in range(d_tp)]
    src_pages, dst_pages = np.array([1, 3]), np.array([2, 1])
    writes = [np.zeros(d.nbytes, dtype=np.int64) for d in dst]
    for part in plan_parts("mha", heads, p_tp, d_tp):
        slices = part.slices or (HeadSlice(0, 0, len(rank_heads(heads, d_tp, part.decode_rank))),)
        s = slice_descs(0, geometry(p_tp), src_pages, slices, True, 0)
        d = slice_descs(0, geometry(d_tp), dst_pages, slices, False, 0)
        assert s[:, 1].tolist() == d[:, 1].tolist()
        sb, db = src[part.prefill_rank].view(np.uint8).reshape(-1), dst[part.decode_rank].view(np.uint8).reshape(-1)
        for (sa, n, _), (da, _, _) in zip(s.tolist(), d.tolist()):
            db[da:da + n] = sb[sa:sa + n]
            writes[part.decode_rank][da:da + n] += 1
    for r in range(d_tp):
        want = pool(d_tp, r, True)
        for sp, dp in zip(src_pages, dst_pages):  # page dp holds source page sp's values of rank r's heads
            assert np.array_equal(dst[r][dp], want[sp]), (r, sp, dp)
        assert set(np.unique(writes[r])) <= {0, 1}  # no byte written twice


def test_describe_says_what_is_converted():
    text = describe(plan_parts("mha", 4, 2, 1), "mha", 2, 1)
    assert text.startswith("TP 2 -> 1 (KV heads split/merged)")
    assert "decode rank 0 <- prefill rank 1 (heads 0..1 as 2..3)" in text
    assert "latent replicated" in describe(plan_parts("mla", 1, 2, 1), "mla", 2, 1)


def test_tp_conversion_passes_the_handshake_and_is_returned():
    converted = check_compatible(info("p-h-1-tp0-a"), info(num_kv_heads=2, tp_size=2, tp_rank=1))
    assert {m.field for m in converted} == {"num_kv_heads", "tp_size", "tp_rank"}
    assert all(m.convertible for m in converted)


@pytest.mark.parametrize("remote, fields", [
    ({"num_kv_heads": 1, "tp_size": 2}, {"num_kv_heads"}),             # 4 heads against 2: another model
    ({"num_kv_heads": 2, "tp_size": 2, "page_size": 64}, {"page_size"}),  # page size is never converted
    ({"num_kv_heads": 2, "tp_size": 2, "kv_cache_dtype": "bf16"}, {"kv_cache_dtype"}),
])
def test_what_cannot_be_converted_is_refused_naming_both_sides(remote, fields):
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(info("prefill-h-1-tp0-aaa"), info(**remote))
    e = err.value
    assert fields <= {m.field for m in e.mismatches if not m.convertible}
    assert "prefill-h-1-tp0-aaa" in str(e) and "decode-h-1-tp0-abc" in str(e) and "(fatal)" in str(e)


def test_heads_per_rank_convert_between_any_sizes_holding_the_same_heads():
    ms = compare(info("p-h-1-tp0-a", num_kv_heads=6, tp_size=1), info(num_kv_heads=2, tp_size=3))
    assert [(m.field, m.convertible) for m in ms] == [("num_kv_heads", True), ("tp_size", True)]
    with pytest.raises(ValueError, match="do not split"):
        rank_heads(6, 4, 0)


def test_a_ticket_carries_its_head_slices_and_refuses_malformed_ones():
    from pd_cluster.transfer.ticket import KVTicket, TPTicket, parse_ticket

    part = KVTicket("t@a.1", "t", "decode-r0", "prefill-r1", (3, 4), 20, 16, heads=((0, 2, 2),))
    assert part.to_dict()["heads"] == [[0, 2, 2]]
    assert "heads" not in KVTicket("t@a.1", "t", "decode-r0", "prefill-r0", (3, 4), 20, 16).to_dict()  # old format
    both = parse_ticket(TPTicket((part, KVTicket("t@a.2", "t", "decode-r0", "prefill-r0", (3, 4), 20, 16,
                                                 heads=((0, 0, 2),)))).to_dict())
    assert [t.heads for t in both.tickets] == [((0, 2, 2),), ((0, 0, 2),)]
    with pytest.raises(ValueError, match="head slice"):
        parse_ticket(dict(part.to_dict(), heads=[[0, 2, 0]]))
