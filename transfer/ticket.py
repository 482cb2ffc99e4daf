"""The handover ticket: what decode tells prefill about one transfer.

Decode reserves the pages first (it never asks for KV it cannot hold), then
`KVReceiver.expect` makes a ticket. The decode worker sends it to the prefill
worker with the request (over HTTP); the prefill worker gives it to
`KVSender.add_request`. Both agents' names are in it, incarnation ids
included, so either side can tell the other's metadata is stale before any
byte moves (vllm #49238).

Delta transfers. A decode worker whose own prefix cache already holds the
prompt's first pages sends a ticket with ``first_page`` > 0: ``dst_pages``
then covers only pages ``[first_page, ceil(num_tokens / page_size))`` and the
prefill worker pushes only those. The field is written only when non-zero, and
a ticket that carries it has fewer pages than its ``num_tokens`` need, so a
prefill worker that predates the field refuses it at parsing (400
``invalid_job``: the page count does not match) instead of pushing the prompt's
first pages into the wrong decode pages.

KV cache groups. A hybrid model's pool (``engine/kv/groups.py``) keeps one block
table per group, and a windowed group's decode reads only the pages of its
window. Such a ticket carries ``group_first_pages``: per group, the first
prompt page decode receives (its own cached pages and, for a windowed group,
the pages behind the window of its first query are not moved). Its
``dst_pages`` are the *slots* of those pages in prompt-page order, group after
group within a page (`group_slots`), so the pages a chunk completes are one
contiguous run of slots and a push still covers ``[page_start, +num_pages)``
of them. ``first_page`` is the smallest group's first page. The field is
written only for a grouped pool. A prefill worker that predates it never gets
such a ticket: the handshake refuses its layout first (the new side compares
``kv_groups``, which an old layout lacks); its parser would not always refuse
one (at a chunk and page boundary the page count can match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVTicket:
    """One transfer of one request's prompt KV from a prefill pool into a decode pool.

    Attributes:
        transfer_id: unique per attempt (a retried request gets a new one), so a
            late notification of an old attempt never completes a new one.
        request_id: the request's id (``X-Request-Id``), for logs and events.
        decode_agent: the receiving agent's name (with its incarnation).
        prefill_agent: the sending agent's name as decode knows it.
        dst_pages: decode's reserved page ids, in token order, for the prompt's pages
            ``[first_page, first_page + len(dst_pages))``.
        num_tokens: the prompt's tokens (the whole prompt, held pages included).
        page_size: tokens per page (both sides agree; checked at the handshake).
        first_page: how many leading prompt pages decode already holds (its own prefix
            cache); they are not transferred. 0: the whole prompt is transferred.
            With `group_first_pages`: their smallest.
        group_first_pages: a grouped pool's first prompt page received per KV group (module doc);
            empty for one group.
        heads: the KV head slices moved, ``(src_head, dst_head, num_heads)`` rank-local on each side, when the
            two workers' TP sizes differ (`pd_cluster.transfer.tp_plan`); empty: whole pages.
    """

    transfer_id: str
    request_id: str
    decode_agent: str
    prefill_agent: str
    dst_pages: tuple[int, ...]
    num_tokens: int
    page_size: int
    first_page: int = 0
    group_first_pages: tuple[int, ...] = ()
    heads: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        total = -(-self.num_tokens // self.page_size) if self.page_size > 0 else -1
        need = total - self.first_page
        if self.group_first_pages:
            firsts = self.group_first_pages
            if self.num_tokens >= 1 and (min(firsts) != self.first_page or max(firsts) > total):
                raise ValueError(f"ticket {self.transfer_id}: group first pages {list(firsts)} must lie in "
                                 f"[0, {total}] with first_page={self.first_page} their smallest")
            need = sum(total - f for f in firsts)
        if self.num_tokens >= 1 and not 0 <= self.first_page < total:
            raise ValueError(f"ticket {self.transfer_id}: first_page={self.first_page} must be in [0, {total}) "
                             f"for {self.num_tokens} tokens of page size {self.page_size}")
        if self.num_tokens < 1 or len(self.dst_pages) != need:
            raise ValueError(f"ticket {self.transfer_id}: {len(self.dst_pages)} pages for {self.num_tokens} "
                             f"tokens of page size {self.page_size} from page {self.first_page} (need {need})")

    @property
    def num_pages(self) -> int:
        """Pages transferred (``len(dst_pages)``)."""
        return len(self.dst_pages)

    @property
    def num_prompt_pages(self) -> int:
        """Pages of the whole prompt: ``ceil(num_tokens / page_size)``."""
        return -(-self.num_tokens // self.page_size)

    @property
    def num_groups(self) -> int:
        """KV groups the pages cover (1 without `group_first_pages`)."""
        return len(self.group_first_pages) or 1

    def slot(self, page: int) -> int:
        """Index into `dst_pages` of prompt page `page`'s first slot: how many slots come before it."""
        firsts = self.group_first_pages or (self.first_page,)
        return sum(max(min(page, self.num_prompt_pages) - f, 0) for f in firsts)

    def to_dict(self) -> dict:
        d = {"transfer_id": self.transfer_id, "request_id": self.request_id,
             "decode_agent": self.decode_agent, "prefill_agent": self.prefill_agent,
             "dst_pages": list(self.dst_pages), "num_tokens": self.num_tokens, "page_size": self.page_size}
        if self.first_page:  # only then: an older prefill worker must refuse it (module doc)
            d["first_page"] = self.first_page
        if self.group_first_pages:
            d["group_first_pages"] = list(self.group_first_pages)
        if self.heads:
            d["heads"] = [list(h) for h in self.heads]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> KVTicket:
        """Parse `to_dict` output.

        Raises:
            ValueError: missing or malformed fields.
        """
        try:
            return cls(str(d["transfer_id"]), str(d["request_id"]), str(d["decode_agent"]),
                       str(d["prefill_agent"]), tuple(int(p) for p in d["dst_pages"]),
                       int(d["num_tokens"]), int(d["page_size"]), int(d.get("first_page", 0)),
                       tuple(int(f) for f in d.get("group_first_pages", ())),
                       tuple(_head_slice(h) for h in d.get("heads", ())))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV ticket: {e!r}") from e


def _head_slice(h) -> tuple[int, int, int]:
    src, dst, n = (int(x) for x in h)
    if src < 0 or dst < 0 or n < 1:
        raise ValueError(f"malformed KV ticket: head slice {h!r}")
    return src, dst, n


@dataclass(frozen=True)
class TPTicket:
    """The tickets of one request on a tensor-parallel pair: one per `pd_cluster.transfer.tp_plan.Part` (a
    (prefill rank, decode rank) pair; each ticket names those two ranks' agents), decode rank by decode rank. With
    equal TP sizes, ticket r is rank r's to rank r's.

    Decode rank 0's first ticket names the transfer: its ids are the ones the workers see.
    """

    tickets: tuple[KVTicket, ...]

    def __post_init__(self) -> None:
        if not self.tickets:
            raise ValueError("a TP ticket needs one ticket per rank, got none")

    @property
    def transfer_id(self) -> str:
        return self.tickets[0].transfer_id

    @property
    def request_id(self) -> str:
        return self.tickets[0].request_id

    @property
    def decode_agent(self) -> str:
        """Rank 0's decode agent (the name the decode worker's served info carries)."""
        return self.tickets[0].decode_agent

    @property
    def prefill_agent(self) -> str:
        return self.tickets[0].prefill_agent

    @property
    def dst_pages(self) -> tuple[int, ...]:
        """The page ids, the same on every rank (rank 0's allocator)."""
        return self.tickets[0].dst_pages

    @property
    def num_pages(self) -> int:
        return self.tickets[0].num_pages

    @property
    def first_page(self) -> int:
        """Leading prompt pages decode already holds (the same on every rank)."""
        return self.tickets[0].first_page

    @property
    def group_first_pages(self) -> tuple[int, ...]:
        """A hybrid pool's first received page per KV group (the same on every rank)."""
        return self.tickets[0].group_first_pages

    @property
    def num_tokens(self) -> int:
        return self.tickets[0].num_tokens

    def to_dict(self) -> dict:
        return {"tp": [t.to_dict() for t in self.tickets]}


Ticket = KVTicket | TPTicket


def group_slots(tables: Sequence[Sequence[int]], firsts: Sequence[int], start: int, stop: int) -> list[int]:
    """The page ids of prompt pages ``[start, stop)`` in slot order (module doc): for each page, the page of
    every group that receives it (group ``g`` from page ``firsts[g]`` on), group 0 first.

    Args:
        tables: each group's block table (group 0 first), covering at least `stop` pages where received.
        firsts: each group's first received page (`KVTicket.group_first_pages`, or ``(first_page,)``).

    Raises:
        ValueError: a table is too short, or the group counts differ.
    """
    if len(tables) != len(firsts):
        raise ValueError(f"{len(tables)} block tables for {len(firsts)} KV groups")
    out: list[int] = []
    for page in range(start, stop):
        for table, first in zip(tables, firsts):
            if page >= first:
                if page >= len(table):
                    raise ValueError(f"a block table of {len(table)} pages has no page {page}")
                out.append(table[page])
    return out


def parse_ticket(d: dict) -> Ticket:
    """A ticket from its JSON form (a `TPTicket` when it has ``tp``).

    Raises:
        ValueError: malformed.
    """
    if not isinstance(d, dict):
        raise ValueError(f"malformed KV ticket: expected an object, got {type(d).__name__}")
    if "tp" in d:
        if not isinstance(d["tp"], list):
            raise ValueError("malformed KV ticket: 'tp' must be a list of tickets")
        return TPTicket(tuple(KVTicket.from_dict(t) for t in d["tp"]))
    return KVTicket.from_dict(d)
