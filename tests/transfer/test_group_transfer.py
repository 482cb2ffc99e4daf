"""KV cache groups over real NIXL (two agents in one process): a hybrid pool's ticket names, per group, the pages
decode receives; each chunk's push covers one contiguous run of slots across the groups, a windowed group sends
only its window, and the bytes land page for page. The handshake compares the groups, and a ticket for another
number of groups is refused.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry
from protocol_kit import polls

from pd_cluster.engine.kv.groups import KVGroup, KVGroups
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.transfer.agent import TransferAgent
from pd_cluster.transfer.config import TransferConfig
from pd_cluster.transfer.errors import LayoutMismatchError
from pd_cluster.transfer.layout import check_compatible
from pd_cluster.transfer.metrics import TransferMetrics
from pd_cluster.transfer.receiver import KVReceiver
from pd_cluster.transfer.sender import KVSender
from pd_cluster.transfer.ticket import KVTicket, group_slots

# 4 layers: 0 and 2 full, 1 and 3 sliding (window 16); two layers a page
GROUPS = KVGroups((KVGroup(("full", 0), (0, 2)), KVGroup(("sliding", 16), (1, 3))), 4)
LAYOUT = KVLayout(4, 2, 8, 16, "fp32", (1.0,) * 4, (1.0,) * 4, layers_per_page=2, kv_groups=GROUPS.signature())


class Side:
    def __init__(self, role: str, layout: KVLayout = LAYOUT, groups: KVGroups | None = GROUPS) -> None:
        self.pool = KVPool(layout, 40, "cpu", torch.float32, groups)
        self.registry = CollectorRegistry()
        self.agent = TransferAgent(self.pool, "model-h", role, TransferConfig(kv_transfer_timeout=5.0))
        m = TransferMetrics(self.registry)
        self.sender = KVSender(self.agent, m) if role == "prefill" else None
        self.receiver = KVReceiver(self.agent, m) if role == "decode" else None


@pytest.fixture(scope="module")
def pair():
    p, d = Side("prefill"), Side("decode")
    p.agent.connect(d.agent.info)
    d.agent.connect(p.agent.info)
    yield p, d
    p.agent.close()
    d.agent.close()


def test_slots_follow_prompt_pages_then_groups():
    t = KVTicket("x", "r", "d", "p", tuple(range(1, 8)), 80, 16, 0, (0, 3))  # 5 pages: full 0..4, window 3..4
    assert t.num_groups == 2 and [t.slot(i) for i in range(6)] == [0, 1, 2, 3, 5, 7]
    tables = [[11, 12, 13, 14, 15], [0, 0, 0, 23, 24]]
    assert group_slots(tables, (0, 3), 2, 5) == [13, 14, 23, 15, 24]
    assert KVTicket.from_dict(t.to_dict()) == t and t.to_dict()["group_first_pages"] == [0, 3]
    with pytest.raises(ValueError, match="pages for 80 tokens"):  # an older decoder's page count: refused
        KVTicket("x", "r", "d", "p", tuple(range(1, 6)), 80, 16, 0, (0, 3))
    with pytest.raises(ValueError, match="smallest"):
        KVTicket("x", "r", "d", "p", tuple(range(1, 8)), 80, 16, 1, (0, 3))


def test_chunked_pushes_move_only_the_window_page_for_page(pair):
    p, d = pair
    gen = torch.Generator().manual_seed(5)
    p.pool.kv[1:12] = torch.randn(p.pool.kv[1:12].shape, generator=gen)
    # a 90-token prompt (6 pages): the first decode query (position 90) reads from 75, page 4, in the window group
    full, window = [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 9, 10]  # prefill trimmed pages 0..3 of the window group
    firsts = (0, 4)
    dst_full, dst_window = [21, 22, 23, 24, 25, 26], [31, 32]
    dst = group_slots([dst_full, [0, 0, 0, 0, *dst_window]], firsts, 0, 6)
    t = d.receiver.expect("h1", dst, 90, p.agent.name, 0, firsts)
    p.sender.add_request(t)
    assert p.sender.push(t.transfer_id, full[:2], 32, group_tables=[window[:2]]) == 2  # pages 0, 1: full only
    assert p.sender.push(t.transfer_id, full[:5], 80, group_tables=[window[:5]]) == 4  # pages 2..4, window 4
    assert p.sender.push(t.transfer_id, full, 90, meta={"first_token_id": 3}, group_tables=[window]) == 2
    done = None
    for _ in polls(200):
        p.sender.poll()
        ev = d.receiver.poll()
        if ev.completed or ev.failed:
            assert not ev.failed, ev.failed
            done = ev.completed[0]
            break
    assert done is not None and done.meta == {"first_token_id": 3}
    assert torch.equal(d.pool.read_pages(dst_full), p.pool.read_pages(full))
    assert torch.equal(d.pool.read_pages(dst_window), p.pool.read_pages([9, 10]))
    assert done.nbytes == 8 * LAYOUT.page_nbytes  # 6 full-group pages + the window's 2, not 12


def test_a_ticket_for_another_number_of_groups_is_refused(pair):
    p, d = pair
    one = KVTicket("one-group", "r", d.agent.name, p.agent.name, (1, 2), 20, 16)
    with pytest.raises(ValueError, match="1 KV group"):
        p.sender.add_request(one)


def test_handshake_compares_the_groups():
    other = KVGroups((KVGroup(("full", 0), (0, 1)), KVGroup(("sliding", 16), (2, 3))), 4)
    a = Side("prefill")
    b = Side("decode", KVLayout(4, 2, 8, 16, "fp32", (1.0,) * 4, (1.0,) * 4, layers_per_page=2,
                                kv_groups=other.signature()), other)
    try:
        with pytest.raises(LayoutMismatchError, match="kv_groups"):
            check_compatible(a.agent.info, b.agent.info)
    finally:
        a.agent.close()
        b.agent.close()
