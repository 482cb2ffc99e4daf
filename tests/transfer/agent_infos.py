"""`AgentInfo` payloads for tests that need no NIXL agent (layout checks, the HTTP directory)."""

from __future__ import annotations

from pd_cluster.transfer.layout import AgentInfo


def info(name="decode-h-1-tp0-abc", **layout) -> AgentInfo:
    lay = dict(num_layers=5, num_kv_heads=4, head_dim=8, page_size=16, kv_cache_dtype="fp8_e4m3",
               k_scales=[0.5] * 5, v_scales=[0.25] * 5, tp_size=1, tp_rank=0, order="page,layer,kv,head,token,dim")
    model = layout.pop("model_identity", "m" * 64)
    lay.update(layout)
    elem = 1 if lay["kv_cache_dtype"] == "fp8_e4m3" else 2
    lay["page_nbytes"] = lay["num_layers"] * 2 * lay["num_kv_heads"] * lay["page_size"] * lay["head_dim"] * elem
    return AgentInfo(name, name.rsplit("-", 1)[1], "decode", model, lay, 10, "DRAM", 0, 4096,
                     11 * lay["page_nbytes"], 1 << 20, 40, b"\x00nixl")
