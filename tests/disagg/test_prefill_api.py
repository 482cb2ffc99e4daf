"""The typed ``/prefill`` request and response both roles share."""

from __future__ import annotations

import json

import pytest

from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.disagg.prefill_api import PrefillRequest, PrefillResponse, PrefillTimings, first_token_params
from pd_cluster.transfer.ticket import KVTicket, TPTicket

TICKET = KVTicket("r@inc.1", "r", "decode-h-1-tp0-a", "prefill-h-2-tp0-b", (4, 5), 20, 16)


def _request(ticket=TICKET, **sampling) -> PrefillRequest:
    params = first_token_params(SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_tokens=3,
                                               stop=["The end"], **sampling))
    return PrefillRequest("r", tuple(range(3, 23)), "http://127.0.0.1:9", ticket, params)


def test_first_token_params_sample_one_token_as_a_mixed_worker_would():
    p = first_token_params(SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_tokens=3, stop=["x"],
                                          logprobs=2))
    assert (p.max_tokens, p.min_tokens, p.stop, p.temperature, p.seed, p.logprobs) == (1, 1, [], 0.8, 7, 2)


@pytest.mark.parametrize("ticket", [TICKET, TPTicket((TICKET, KVTicket("r@inc.2", "r", "d1", "p1", (4, 5), 20, 16)))])
def test_request_round_trips(ticket):
    req = _request(ticket)
    back = PrefillRequest.from_json(req.to_json())
    assert back == req and type(back.ticket) is type(ticket)


def test_nan_cannot_be_sent():
    req = _request()
    req.sampling.temperature = float("nan")
    with pytest.raises(ValueError, match="JSON"):
        req.to_json()


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("ticket"), "missing 'ticket'"),
    (lambda d: d.update(prompt_token_ids=[]), "prompt_token_ids"),
    (lambda d: d.update(prompt_token_ids=[1, "2"]), "prompt_token_ids"),
    (lambda d: d.update(request_id=5), "request_id"),
    (lambda d: d["sampling"].update(temperature=-1.0), "temperature"),
    (lambda d: d["sampling"].update(best_of=2), "unknown sampling fields"),
    (lambda d: d["ticket"].update(dst_pages=[4]), "ticket"),
])
def test_malformed_requests_name_the_field(mutate, message):
    d = json.loads(_request().to_json())
    mutate(d)
    with pytest.raises(ValueError, match=message):
        PrefillRequest.from_json(json.dumps(d).encode())
    with pytest.raises(ValueError, match="malformed"):
        PrefillRequest.from_json(b"[1, 2]")


def test_response_round_trips_and_carries_no_first_token():
    resp = PrefillResponse("r", 3, 4096, PrefillTimings(0.01, 0.2, 0.003))
    d = resp.to_dict()
    assert "first_token_id" not in json.dumps(d)
    assert PrefillResponse.from_dict(d) == resp
    with pytest.raises(ValueError):
        PrefillResponse.from_dict({"request_id": "r"})


# ---- delta tickets (the decode worker's cache holds the prompt's first pages) ----------------------------------
DELTA = KVTicket("r@inc.3", "r", "decode-h-1-tp0-a", "prefill-h-2-tp0-b", (9, 4), 50, 16, first_page=2)


def test_a_delta_ticket_round_trips_and_names_the_held_pages():
    req = _request(DELTA)
    back = PrefillRequest.from_json(req.to_json())
    assert back == req and back.decode_cached_pages == 2
    assert (DELTA.num_pages, DELTA.num_prompt_pages) == (2, 4)
    assert "first_page" not in TICKET.to_dict() and KVTicket.from_dict(TICKET.to_dict()).first_page == 0


@pytest.mark.parametrize("pages, first", [((9, 4), 1), ((9, 4, 5), 2), ((), 4), ((9,), -1), ((9,), 4)])
def test_a_delta_ticket_must_cover_exactly_the_pages_after_the_held_ones(pages, first):
    with pytest.raises(ValueError, match="first_page|pages"):
        KVTicket("t", "r", "d", "p", pages, 50, 16, first_page=first)  # 50 tokens: 4 pages of 16


def test_a_prefill_worker_that_predates_delta_tickets_refuses_them():
    from legacy_ticket import KVTicket as OldTicket

    assert OldTicket.from_dict(TICKET.to_dict()).dst_pages == TICKET.dst_pages  # full tickets still parse
    with pytest.raises(ValueError, match=r"2 pages for 50 tokens of page size 16 \(need 4\)"):
        OldTicket.from_dict(DELTA.to_dict())  # never read as "the prompt's first two pages go to 9 and 4"


@pytest.mark.parametrize("path", ["prefill", "abort"])
def test_a_decode_that_leaves_mid_body_gets_499_not_a_traceback(path, caplog):
    """Starlette raises ClientDisconnect from ``request.body()`` when the peer closes mid-body (a decode that gave
    up); the handler answers 499 (nobody reads it) instead of letting it escape as an unhandled exception."""
    import asyncio

    from starlette.requests import Request

    from pd_cluster.prefill.server import CLIENT_CLOSED, PrefillServer

    # the handlers read the body before touching the engine, the loop or the transfer agent
    server = PrefillServer(None, None, None, None, None, None)  # type: ignore[arg-type]
    messages = [{"type": "http.request", "body": b'{"request_id": "r1", "prompt_tok', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/" + path, "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")]}
    with caplog.at_level("INFO"):
        response = asyncio.run(getattr(server, path)(Request(scope, receive)))
    assert response.status_code == CLIENT_CLOSED
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
