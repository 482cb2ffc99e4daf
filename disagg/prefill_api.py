"""The ``POST /prefill`` call from a decode worker to a prefill worker: its typed request and response.

Both roles import this module (`pd_cluster.disagg`; neither imports the other). The body is JSON;
`PrefillRequest.to_json` refuses NaN and infinities (they are not JSON), and
`from_json` validates every field, so a malformed job is a 400 naming it.

The first token travels once, in the NIXL notification of the last push
(`protocol.Push.meta`), not in this response. That notification is sent only
after the last WRITE completed, so it arrives ordered after the prompt's KV:
decode learns "the KV is here" and "this is the first token" in the same
`KVReceiver.poll`, and starts decoding without waiting for the HTTP answer,
which comes later (the sender reports completion only after the notification
left). The response carries what only the HTTP side needs: the push count,
the bytes and where prefill spent its time. The prompt tokens that prefill's
prefix cache served (``num_cached_tokens``) ride both: in the last push's
notification, so that decode knows them before its first delta, and in this
response for the HTTP side.

Delta transfers. When the decode worker's own prefix cache holds the prompt's
first pages, the ticket says so (``KVTicket.first_page``) and covers only the
rest. The prefill worker still needs the whole prompt's KV to compute the
suffix (its own cache serves what it can, it computes the rest), samples the
first token as always, and pushes only the pages from ``first_page`` on. A
prefill worker that predates the field refuses such a ticket (400
``invalid_job``, see ``transfer/ticket.py``); it never pushes into the wrong
pages.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.transfer.ticket import Ticket, parse_ticket

PATH = "/prefill"
ABORT_PATH = "/abort"


def first_token_params(params: SamplingParams, num_resumed: int = 0) -> SamplingParams:
    """What the prefill worker needs to sample its one token exactly as a mixed worker would.

    That token comes after `num_resumed` output tokens (`PrefillRequest.resumed_output_ids`; 0 for a new
    request): the output ends with it (``max_tokens``), and EOS is banned while ``min_tokens`` is not reached."""
    n = num_resumed + 1
    return dataclasses.replace(params, max_tokens=n, min_tokens=min(params.min_tokens, n), stop=None)


@dataclass(frozen=True)
class PrefillRequest:
    """One prefill job: the prompt, how to sample its first token, and where its KV goes.

    Attributes:
        request_id: decode's engine id of the request (unique per attempt).
        prompt_token_ids: the prompt's token ids.
        decode_url: the decode worker's base URL (prefill fetches its agent info there).
        ticket: decode's reserved pages (`KVTicket`, or a `TPTicket` under tensor parallelism), for the
            prompt's pages from `decode_cached_pages` on.
        sampling: the first token's parameters (`first_token_params` of the request's).
        resumed_output_ids: output generated before this attempt (a migrated stream): prefill computes their
            KV after the prompt's and pushes both (the ticket's ``num_tokens`` counts them), then samples the
            token after them with their penalties, grammar state and seeded draws replayed.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    decode_url: str
    ticket: Ticket
    sampling: SamplingParams
    resumed_output_ids: tuple[int, ...] = ()

    @property
    def decode_cached_pages(self) -> int:
        """Leading prompt pages no KV group of the decode worker receives (``ticket.first_page``): those its own
        cache holds, and for a model whose every layer is windowed, also those behind every window."""
        return self.ticket.first_page

    def to_dict(self) -> dict:
        d = {"request_id": self.request_id, "prompt_token_ids": list(self.prompt_token_ids),
             "decode_url": self.decode_url, "ticket": self.ticket.to_dict(),
             "sampling": dataclasses.asdict(self.sampling)}
        if self.resumed_output_ids:
            d["resumed_output_ids"] = list(self.resumed_output_ids)
        return d

    def to_json(self) -> bytes:
        """The request body.

        Raises:
            ValueError: a sampling value is NaN or infinite (not representable in JSON).
        """
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PrefillRequest:
        """Parse and validate a request body.

        Raises:
            ValueError: malformed JSON, a missing or mistyped field (named), or invalid sampling
                parameters (`SamplingParamError`, which names the parameter).
        """
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed prefill job: {e}") from e
        if not isinstance(d, dict):
            raise ValueError("malformed prefill job: the body must be a JSON object")
        for name in ("request_id", "prompt_token_ids", "decode_url", "ticket"):
            if name not in d:
                raise ValueError(f"malformed prefill job: missing {name!r}")
        if not isinstance(d["request_id"], str) or not isinstance(d["decode_url"], str):
            raise ValueError("malformed prefill job: 'request_id' and 'decode_url' must be strings")
        ids = d["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise ValueError("malformed prefill job: 'prompt_token_ids' must be a non-empty list of ints")
        resumed = d.get("resumed_output_ids", [])
        if not isinstance(resumed, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in resumed):
            raise ValueError("malformed prefill job: 'resumed_output_ids' must be a list of ints")
        sampling = d.get("sampling", {})
        if not isinstance(sampling, dict):
            raise ValueError("malformed prefill job: 'sampling' must be an object")
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(sampling) - fields)
        if unknown:
            raise ValueError(f"malformed prefill job: unknown sampling fields {unknown}")
        return cls(d["request_id"], tuple(ids), d["decode_url"], parse_ticket(d["ticket"]),
                   SamplingParams(**sampling), tuple(resumed))


@dataclass(frozen=True)
class PrefillTimings:
    """Where the prefill worker spent a job's time, in seconds.

    Attributes:
        queue_s: from the job's arrival to its first scheduled chunk.
        prefill_s: from the first scheduled chunk to the last one.
        push_tail_s: from the last chunk to the last push's completion.
    """

    queue_s: float = 0.0
    prefill_s: float = 0.0
    push_tail_s: float = 0.0


@dataclass(frozen=True)
class PrefillResponse:
    """The 200 answer, sent once every push completed (the first token came with the last push).

    Attributes:
        request_id: as in the request.
        num_pushes: WRITEs the transfer took.
        nbytes: bytes written into decode's pages (those from the ticket's ``first_page`` on).
        timings: `PrefillTimings`.
        num_cached_tokens: prompt tokens whose KV came from the prefill worker's prefix cache (not
            computed there; OpenAI's ``usage.prompt_tokens_details.cached_tokens``). Independent of
            what the decode worker held: that saves the transfer of those pages, not their compute.
    """

    request_id: str
    num_pushes: int
    nbytes: int
    timings: PrefillTimings
    num_cached_tokens: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PrefillResponse:
        """Parse a 200 body.

        ``num_cached_tokens`` may be absent (a prefill worker without a prefix cache): 0.

        Raises:
            ValueError: missing or mistyped fields, or a negative ``num_cached_tokens``.
        """
        try:
            t = d["timings"]
            cached = int(d.get("num_cached_tokens", 0))
            if cached < 0:
                raise ValueError(f"num_cached_tokens={cached} is negative")
            return cls(str(d["request_id"]), int(d["num_pushes"]), int(d["nbytes"]),
                       PrefillTimings(float(t["queue_s"]), float(t["prefill_s"]), float(t["push_tail_s"])),
                       cached)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed prefill response: {e!r}") from e
