"""The `KVTicket` of prefill workers that predate delta transfers (``first_page``), kept for one test.

Copied from ``transfer/ticket.py`` as it was before the field existed (only the class, unchanged), so that
``test_prefill_api.py`` can show that such a worker refuses a delta ticket instead of pushing the prompt's
first pages into the wrong decode pages.
"""

from __future__ import annotations

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
        dst_pages: decode's reserved page ids, in token order.
        num_tokens: prompt tokens whose KV is transferred.
        page_size: tokens per page (both sides agree; checked at the handshake).
    """

    transfer_id: str
    request_id: str
    decode_agent: str
    prefill_agent: str
    dst_pages: tuple[int, ...]
    num_tokens: int
    page_size: int

    def __post_init__(self) -> None:
        need = -(-self.num_tokens // self.page_size) if self.page_size > 0 else -1
        if self.num_tokens < 1 or len(self.dst_pages) != need:
            raise ValueError(f"ticket {self.transfer_id}: {len(self.dst_pages)} pages for {self.num_tokens} "
                             f"tokens of page size {self.page_size} (need {need})")

    @property
    def num_pages(self) -> int:
        return len(self.dst_pages)

    def to_dict(self) -> dict:
        return {"transfer_id": self.transfer_id, "request_id": self.request_id,
                "decode_agent": self.decode_agent, "prefill_agent": self.prefill_agent,
                "dst_pages": list(self.dst_pages), "num_tokens": self.num_tokens, "page_size": self.page_size}

    @classmethod
    def from_dict(cls, d: dict) -> KVTicket:
        """Parse `to_dict` output.

        Raises:
            ValueError: missing or malformed fields.
        """
        try:
            return cls(str(d["transfer_id"]), str(d["request_id"]), str(d["decode_agent"]),
                       str(d["prefill_agent"]), tuple(int(p) for p in d["dst_pages"]),
                       int(d["num_tokens"]), int(d["page_size"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed KV ticket: {e!r}") from e
