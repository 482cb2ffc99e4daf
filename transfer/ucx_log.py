"""Reading UCX's own logs: which transports it chose (used by the transfer benchmarks to report them)."""

from __future__ import annotations


def put_protocols(text: str) -> list[str]:
    """The transports UCX chose for remote memory writes between processes, from its ``UCX_PROTO_INFO=y`` tables.

    Each table has title lines (``| <agent> intra-node cfg#1 |``, ``| remote memory write by ucp_put* ... |``)
    and rows ``| 0..inf | zero-copy | cma/memory |``. Tables of an agent's loopback to itself (``self``) are
    skipped. Returns entries such as ``"0..inf bytes: zero-copy over cma/memory (<agent> intra-node cfg#1)"``.
    """
    found: list[str] = []
    title: list[str] = []
    in_rows = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if not cells:
            continue
        if len(cells) == 1:  # a title line of a new table
            if in_rows:
                title, in_rows = [], False
            title.append(cells[0])
        elif cells[0] == "Range":
            in_rows = True
        elif in_rows and len(cells) == 3:
            heading = " ".join(title)
            if "remote memory write" in heading and "self" not in heading.split():
                entry = f"{cells[0]} bytes: {cells[1]} over {cells[2]} ({heading.split(' remote')[0]})"
                if entry not in found:
                    found.append(entry)
    return found
