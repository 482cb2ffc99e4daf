"""What a worker tells its peers about its KV pool, and the handshake's compatibility check.

`AgentInfo` is the payload each worker serves at ``GET /kv_transfer/info``:
the NIXL agent metadata (opaque bytes, base64 in JSON) plus a layout
descriptor: model identity, the `KVLayout`, the pool's size and the addresses
of its registered regions. A peer loads it once per agent incarnation.

`check_compatible` compares two descriptors field by field and raises
`LayoutMismatchError` naming both sides' values. The fields and their class:

* fatal: protocol version, model identity, number of layers, head_dim, KV
  dtype, FP8 scales, in-page order, KV format (``mha``: K and V per head;
  ``mla``: one latent per token), page size, and KV heads when the TP size is
  the same. Pages from such a peer would decode to different numbers; no
  conversion keeps them exact. A peer that names no KV format (an older
  version) is ``mha``. KV cache groups (a hybrid model's pool,
  ``engine/kv/groups.py``): which layers a page holds, per group; a peer that
  names none keeps one group (every layer in every page), whose pages hold
  other bytes.
* converted: TP size and rank, and with them the KV heads per rank, when both
  sides hold the same model's heads (``num_kv_heads * tp_size`` equal) and each
  TP size shards them (`pd_cluster.transfer.tp_plan`): heads are split or
  merged on the way; an ``mla`` latent is replicated on every rank and sent
  once per decode rank. `check_compatible` returns these, and the handshake
  logs what it converts.
* speculative decoding (`AgentInfo.speculative`): ``draft_state``, the
  drafter's state that crosses the transfer beside the target's KV (the
  prefill sends it, the decode expects it), is fatal when the two sides
  differ: one would send what the other does not take, or wait for what
  never comes. The settings themselves (``speculative``: algorithm, K, draft
  model) are named in that error and otherwise only logged
  (`speculative_difference`): while no state crosses, a decode drafts the same
  whatever the prefill runs. A peer that names none (an older version) runs
  none and sends none.

Idea: vLLM's NIXL handshake compatibility hash (vllm PR #29503), made
field-by-field so the error says what differs.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field

from pd_cluster.transfer.errors import LayoutMismatchError, Mismatch
from pd_cluster.transfer.tp_plan import rank_heads

PROTOCOL_VERSION = 1

_FATAL = ("protocol", "model_identity", "num_layers", "head_dim", "page_size", "kv_cache_dtype", "k_scales",
          "v_scales", "order", "kv_format", "kv_groups")
_TP = ("tp_size", "tp_rank")


@dataclass(frozen=True)
class AgentInfo:
    """One worker's transfer agent as its peers see it (JSON-serialisable).

    Attributes:
        agent_name: the NIXL agent name; ends with the incarnation id.
        incarnation: a random id chosen at agent start; a restarted worker has a new one.
        role: ``prefill``, ``decode`` or ``mixed``.
        model_identity: `LoadedModel.identity` (sha256 of config plus weights' metadata).
        layout: `KVLayout.to_dict()` (includes ``page_nbytes``).
        num_pages: usable pages (ids 1..num_pages; 0 is the null page).
        mem_type: ``DRAM`` or ``VRAM``.
        device_id: GPU index for VRAM, 0 for DRAM.
        kv_base, kv_nbytes: address and size of the registered page tensor.
        scales_base, scales_nbytes: address and size of the registered FP8 scales.
        nixl_metadata: the data agent's `nixl_agent.get_agent_metadata()` bytes.
        control_metadata: the control agent's (``<agent_name>.ctl``, messages only).
        protocol: the transfer protocol version.
        speculative: the worker's speculative decoding at the handshake (`SpeculativeConfig.handshake`):
            ``speculative`` (its settings, one line) and ``draft_state`` (a list of names); {}: none.
    """

    agent_name: str
    incarnation: str
    role: str
    model_identity: str
    layout: dict
    num_pages: int
    mem_type: str
    device_id: int
    kv_base: int
    kv_nbytes: int
    scales_base: int
    scales_nbytes: int
    nixl_metadata: bytes = field(repr=False)
    control_metadata: bytes = field(default=b"", repr=False)
    protocol: int = PROTOCOL_VERSION
    tp_peers: tuple[AgentInfo, ...] = ()  # rank 0's info also carries ranks 1..N-1 of its worker
    speculative: dict = field(default_factory=dict)  # ``speculative`` (settings), ``draft_state`` (module doc)

    @property
    def page_nbytes(self) -> int:
        return int(self.layout["page_nbytes"])

    @property
    def layout_hash(self) -> str:
        """Equals `KVLayout.hash()` of the peer's layout (the ``layout_hash`` of its ``/server_info``)."""
        blob = json.dumps(self.layout, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "protocol": self.protocol, "agent_name": self.agent_name, "incarnation": self.incarnation,
            "role": self.role, "model_identity": self.model_identity, "layout": self.layout,
            "num_pages": self.num_pages, "mem_type": self.mem_type, "device_id": self.device_id,
            "kv_base": self.kv_base, "kv_nbytes": self.kv_nbytes,
            "scales_base": self.scales_base, "scales_nbytes": self.scales_nbytes,
            "nixl_metadata": base64.b64encode(self.nixl_metadata).decode("ascii"),
            "control_metadata": base64.b64encode(self.control_metadata).decode("ascii"),
            **({"tp_peers": [p.to_dict() for p in self.tp_peers]} if self.tp_peers else {}),
            **({"speculative": self.speculative} if self.speculative else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> AgentInfo:
        """Parse a payload from `to_dict`.

        Raises:
            ValueError: a field is missing or has the wrong type, or the sizes contradict each other.
        """
        try:
            info = cls(
                agent_name=str(d["agent_name"]), incarnation=str(d["incarnation"]), role=str(d["role"]),
                model_identity=str(d["model_identity"]), layout=dict(d["layout"]),
                num_pages=int(d["num_pages"]), mem_type=str(d["mem_type"]), device_id=int(d["device_id"]),
                kv_base=int(d["kv_base"]), kv_nbytes=int(d["kv_nbytes"]),
                scales_base=int(d["scales_base"]), scales_nbytes=int(d["scales_nbytes"]),
                nixl_metadata=base64.b64decode(d["nixl_metadata"], validate=True),
                control_metadata=base64.b64decode(d["control_metadata"], validate=True),
                protocol=int(d["protocol"]),
                tp_peers=tuple(cls.from_dict(p) for p in d.get("tp_peers", ())),
                speculative=_speculative(d["speculative"]) if "speculative" in d else {},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed KV transfer agent info: {e!r}") from e
        info.validate()
        return info

    def validate(self) -> None:
        """Check the payload is self-consistent (sizes agree with the layout).

        Raises:
            ValueError: naming the inconsistency.
        """
        if not self.agent_name.endswith(self.incarnation):
            raise ValueError(f"agent name {self.agent_name!r} does not carry incarnation {self.incarnation!r}")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        need = (self.num_pages + 1) * self.page_nbytes
        if self.num_pages < 1 or self.kv_nbytes != need:
            raise ValueError(f"kv region of {self.kv_nbytes} bytes does not hold {self.num_pages} + 1 pages "
                             f"of {self.page_nbytes} bytes ({need})")


def compare(local: AgentInfo, remote: AgentInfo) -> list[Mismatch]:
    """Every field on which `remote` differs from `local`, classified (see the module doc)."""
    out: list[Mismatch] = []
    lv, rv = _view(local), _view(remote)
    same_tp = lv["tp_size"] == rv["tp_size"]
    for name in _FATAL:
        if lv[name] != rv[name]:
            out.append(Mismatch(name, lv[name], rv[name], convertible=False))
    if lv["num_kv_heads"] != rv["num_kv_heads"]:
        total = lv["num_kv_heads"] * lv["tp_size"]
        ok = (not same_tp) and total == rv["num_kv_heads"] * rv["tp_size"] and _shards(total, lv, rv)
        out.append(Mismatch("num_kv_heads", lv["num_kv_heads"], rv["num_kv_heads"], convertible=ok))
    for name in _TP:
        if lv[name] != rv[name]:  # the same TP size pairs rank r with rank r only
            out.append(Mismatch(name, lv[name], rv[name], convertible=not same_tp))
    if not out and lv["page_nbytes"] != rv["page_nbytes"]:  # equal fields must give equal bytes
        out.append(Mismatch("page_nbytes", lv["page_nbytes"], rv["page_nbytes"], convertible=False))
    if _draft_state(local) != _draft_state(remote):
        out.append(Mismatch("draft_state", _describe_spec(local), _describe_spec(remote), convertible=False))
    return out


def _speculative(d: dict) -> dict:
    """A peer's ``speculative`` payload, checked: a settings line and a list of state names."""
    if not isinstance(d, dict) or not isinstance(d.get("draft_state", []), list):
        raise ValueError(f"speculative must be an object with a draft_state list, got {d!r}")
    return {"speculative": str(d.get("speculative", "off")), "draft_state": [str(x) for x in d.get("draft_state", [])]}


def _draft_state(info: AgentInfo) -> list[str]:
    return sorted(info.speculative.get("draft_state", ()))


def _describe_spec(info: AgentInfo) -> str:
    """``<draft state or none> (speculative <settings>)``: what a side sends or expects, and why."""
    return f"{', '.join(_draft_state(info)) or 'none'} (speculative {info.speculative.get('speculative', 'off')})"


def speculative_difference(local: AgentInfo, remote: AgentInfo) -> str | None:
    """A line naming both sides' speculative settings when they differ but no transferred state does (logged at
    the handshake; the pair is compatible); None when they agree."""
    mine, theirs = (i.speculative.get("speculative", "off") for i in (local, remote))
    if mine == theirs or _draft_state(local) != _draft_state(remote):
        return None
    return (f"speculative decoding differs between local agent {local.agent_name} ({mine}) and peer "
            f"{remote.agent_name} ({theirs}); compatible: no drafter state crosses the transfer (each decode "
            f"worker computes its own)")


def _shards(total: int, *views: dict) -> bool:
    try:
        for v in views:
            rank_heads(total, v["tp_size"], 0)
    except ValueError:
        return False
    return True


def check_compatible(local: AgentInfo, remote: AgentInfo) -> list[Mismatch]:
    """The handshake check: pages of `local` and `remote` mean the same bytes, or a TP conversion makes them so.

    Returns:
        The mismatches the transfer converts (TP size and rank, heads per rank); empty when the layouts are equal.

    Raises:
        LayoutMismatchError: with every differing field and both values, when one cannot be converted.
    """
    mismatches = compare(local, remote)
    if any(not m.convertible for m in mismatches):
        raise LayoutMismatchError(local.agent_name, remote.agent_name, mismatches)
    return mismatches


def _view(info: AgentInfo) -> dict:
    lay = info.layout
    return {
        "protocol": info.protocol,
        "model_identity": info.model_identity,
        "num_layers": int(lay["num_layers"]),
        "num_kv_heads": int(lay["num_kv_heads"]),
        "head_dim": int(lay["head_dim"]),
        "page_size": int(lay["page_size"]),
        "kv_cache_dtype": str(lay["kv_cache_dtype"]),
        "k_scales": [float(s) for s in lay["k_scales"]],
        "v_scales": [float(s) for s in lay["v_scales"]],
        "tp_size": int(lay.get("tp_size", 1)),
        "tp_rank": int(lay.get("tp_rank", 0)),
        "order": str(lay.get("order", "")),
        "kv_format": str(lay.get("kv_format", "mha")),
        "kv_groups": [str(g) for g in lay.get("kv_groups", ())] or "one group",
        "page_nbytes": int(lay["page_nbytes"]),
    }
