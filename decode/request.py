"""A decode worker's record of one request whose prompt is prefilled remotely: its whole life, one owner.

States (`RemoteState`) and the only legal moves::

    QUEUED ──▶ RESERVED ──▶ ARRIVING ──▶ RUNNING
       │  │        │            │           ▲
       │  └────────┼────────────┼───────────┘ (prefilled here: --max-local-prefill-length)
       └───────────┴────────────┴──▶ FAILED ──▶ QUARANTINED ──▶ RELEASED
                                       └──────────────────────────▲

* ``QUEUED``: in the engine's queue, no pages yet (SGLang's decode prealloc queue).
* ``RESERVED``: the scheduler reserved the prompt's pages and the receiver made the ticket; the ticket has not
  left this worker, so nobody can write into the pages. The prompt's leading pages that this worker's prefix
  cache held are referenced by the request, not reserved: the ticket starts after them (``first_page``), so no
  WRITE can touch them, and they are released with the request's other pages, by the same rule.
* ``ARRIVING``: the ticket is on its way to the prefill worker (or a push of it arrived): its WRITEs may land
  in the pages at any moment.
* ``RUNNING``: every push arrived; the request is in the running batch with its first token, and the engine
  owns it (and its pages) from here on. A request whose uncached rest was short enough goes from QUEUED
  straight to RUNNING: the engine prefills it here and no ticket exists (`run_locally`).
* ``FAILED``: the request is over with an error; both futures carry it.
* ``QUARANTINED``: failed while the sender may still write: the pages stay held by the engine, unused.
* ``RELEASED``: the pages are back in the pool.

**A reserved page is free exactly when its record enters RELEASED**, which happens

1. at the failure itself when no WRITE can come: the request failed while QUEUED or RESERVED, or the prefill
   worker refused the ticket before any push of it arrived (`KVReceiver.withdraw` succeeded); or
2. when the receiver reports `PagesReleased` for a QUARANTINED request: the sender said it stopped, its
   process is gone, or the quarantine (``--kv-transfer-abort-quarantine``) expired.

A RUNNING request's pages are the engine's, freed when it finishes. Any other move raises `IllegalTransition`.

Every method runs in the engine thread; the HTTP handler only awaits the futures. The futures' exceptions are
marked retrieved, so a handler that went away (client disconnect) leaves no "Future exception was never
retrieved" behind.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field

from pd_cluster.common.aio import mark_retrieved
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.serving.engine_loop import settle_future
from pd_cluster.transfer.interfaces import Receiver
from pd_cluster.transfer.receiver_events import PagesReleased, RecvDone
from pd_cluster.transfer.ticket import Ticket, group_slots

logger = logging.getLogger("pd.decode")


class RemoteState(enum.Enum):
    QUEUED = "queued"
    RESERVED = "reserved"
    ARRIVING = "arriving"
    RUNNING = "running"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    RELEASED = "released"

    @property
    def over(self) -> bool:
        """The record no longer needs the engine thread's attention."""
        return self in (RemoteState.RUNNING, RemoteState.RELEASED)


S = RemoteState
NEXT: dict[RemoteState, frozenset[RemoteState]] = {
    S.QUEUED: frozenset({S.RESERVED, S.RUNNING, S.FAILED}),
    S.RESERVED: frozenset({S.ARRIVING, S.FAILED}),
    S.ARRIVING: frozenset({S.RUNNING, S.FAILED}),
    S.FAILED: frozenset({S.QUARANTINED, S.RELEASED}),
    S.QUARANTINED: frozenset({S.RELEASED}),
    S.RUNNING: frozenset(),
    S.RELEASED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A `RemoteRequest` was asked to move where its state machine does not go."""


class Refused(Exception):
    """The prefill worker refused the ticket before pushing anything (it answered 400 or 409)."""



@dataclass(eq=False)
class RemoteRequest:
    """One remote-prefill request on the decode worker (see the module doc for the states and the page rule).

    Args:
        request_id: the engine's id of the request.
        prefill_url: the prefill worker's base URL (where ``/prefill`` and ``/abort`` go).
        prefill_agent: that worker's agent name (the ticket names it).
        aloop: the event loop of the handler awaiting the futures.

    Attributes:
        ticket_future: resolves to the `Ticket` at RESERVED, to None when the engine prefills the request
            here (no prefill worker), or raises the failure.
        kv_future: resolves to the `RecvDone` at RUNNING (None when prefilled here), or raises the failure.
        ticket: set at RESERVED.
        error: set at FAILED.
        history: every state entered, in order.
        post: the handler's ``/prefill`` call once sent (handler-side).
        aborted: the handler aborted it (handler-side; the abort is logged and sent to prefill once).
        num_cached_pages: the prompt's leading pages this worker's prefix cache held at RESERVED.
    """

    request_id: str
    prefill_url: str
    prefill_agent: str
    aloop: asyncio.AbstractEventLoop
    state: RemoteState = RemoteState.QUEUED
    ticket: Ticket | None = None
    error: BaseException | None = None
    history: list[RemoteState] = field(default_factory=lambda: [RemoteState.QUEUED])
    post: asyncio.Future | None = None
    aborted: bool = False
    num_cached_pages: int = 0

    def __post_init__(self) -> None:
        self.ticket_future: asyncio.Future = self.aloop.create_future()
        self.kv_future: asyncio.Future = self.aloop.create_future()
        for fut in (self.ticket_future, self.kv_future):
            fut.add_done_callback(mark_retrieved)

    @property
    def transfer_id(self) -> str | None:
        return None if self.ticket is None else self.ticket.transfer_id

    @property
    def holds_pages(self) -> bool:
        """True while pages reserved for this request are not back in the pool and not the running request's."""
        return self.state in (S.RESERVED, S.ARRIVING, S.FAILED, S.QUARANTINED)

    # ---- transitions (engine thread) ---------------------------------------------------------------
    def _to(self, new: RemoteState) -> None:
        if new not in NEXT[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.value} -> {new.value} is not a legal move")
        self.state = new
        self.history.append(new)

    def _settle(self, fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        self.aloop.call_soon_threadsafe(settle_future, fut, result, error)

    def reserve(self, engine: LLMEngine, receiver: Receiver, pages: list[int], num_cached_pages: int = 0,
                group_tables: list[list[int]] = ()) -> None:
        """QUEUED -> RESERVED: the scheduler gave the prompt `pages`; the receiver makes the ticket.

        Args:
            pages: the whole prompt's page ids (a hybrid pool's group 0 table).
            num_cached_pages: how many leading ones this worker's prefix cache held: the ticket covers
                only the rest (a delta transfer), and the prefill worker pushes only those.
            group_tables: a hybrid pool's block tables of KV groups 1..: the ticket covers, per group, the
                pages its decode reads (`KVGroups.transfer_first_pages`: a windowed group's window only; a state
                group's pages with the prompt's last page).

        If the receiver refuses (e.g. the prefill agent was dropped meanwhile), the request fails and its pages
        are released at once: no ticket exists, so nothing can be written.
        """
        if self.state is not S.QUEUED:
            raise IllegalTransition(f"request {self.request_id}: pages reserved while {self.state.value}")
        req = engine.requests[self.request_id]
        self.num_cached_pages = num_cached_pages
        try:
            if engine.kv_groups.is_single:
                ticket = receiver.expect(self.request_id, pages[num_cached_pages:], req.num_tokens,
                                         self.prefill_agent, num_cached_pages)
            else:
                ps = engine.layout.page_size
                firsts = engine.kv_groups.transfer_first_pages(req.num_tokens, ps, num_cached_pages)
                tables = engine.kv_groups.transfer_tables([pages, *group_tables], req.num_tokens, ps)
                slots = group_slots(tables, firsts, min(firsts), -(-req.num_tokens // ps))
                ticket = receiver.expect(self.request_id, slots, req.num_tokens, self.prefill_agent, min(firsts),
                                         firsts)
        except Exception as e:  # noqa: BLE001 - PeerNotConnectedError, ValueError: the request's own failure
            self._fail_now(engine, e)
            return
        self.ticket = ticket
        self._to(S.RESERVED)
        self._settle(self.ticket_future, ticket)

    def run_locally(self) -> None:
        """QUEUED -> RUNNING: the engine admitted the request to prefill it here (``--max-local-prefill-length``).

        No ticket exists and no prefill worker is called; both futures resolve to None, and the engine owns the
        request (and its pages) from here on.
        """
        if self.state is not S.QUEUED:
            raise IllegalTransition(f"request {self.request_id}: prefilled locally while {self.state.value}")
        self._to(S.RUNNING)
        self._settle(self.ticket_future, None)
        self._settle(self.kv_future, None)

    def send(self) -> None:
        """RESERVED -> ARRIVING: the handler is about to send the ticket; WRITEs may come from now on.

        A no-op once the request failed (the handler learns it from the futures).
        """
        if self.state in (S.FAILED, S.QUARANTINED, S.RELEASED):
            return
        self._to(S.ARRIVING)

    def complete(self, engine: LLMEngine, done: RecvDone, first_token: int | None, first_logprob,
                 num_cached_tokens: int = 0, prompt_logprobs: list | None = None) -> bool:
        """ARRIVING -> RUNNING: every push arrived; the request joins the running batch with its first token.

        `num_cached_tokens` (prompt tokens the prefill worker's prefix cache served) is reported in the
        request's usage; `prompt_logprobs` (computed by the prefill worker) in its deltas.

        A completion seen while RESERVED (a push can only exist if the ticket left) passes through ARRIVING.
        Returns False, and fails the request, when the last push carried no first token or the engine no
        longer waits for it.
        """
        if self.state is S.RESERVED:
            self._to(S.ARRIVING)
        if self.state is not S.ARRIVING:
            raise IllegalTransition(f"request {self.request_id}: KV completed while {self.state.value}")
        req = engine.requests.get(self.request_id)
        if req is not None:
            req.times.kv_wait_s = done.wait_s
        ok = first_token is not None and engine.complete_remote_prefill(
            self.request_id, first_token, first_logprob, num_cached_tokens=num_cached_tokens,
            prompt_logprobs=prompt_logprobs)
        if not ok:  # the receiver is done with the pages: nothing writes into them any more
            why = "carried no first token" if first_token is None else "arrived for a request no longer waiting"
            self._to(S.FAILED)
            self.error = RuntimeError(f"request {self.request_id}: the prompt's KV {why}")
            engine.abort_request(self.request_id, release_pages=True)
            self._to(S.RELEASED)
            self._settle_failure(self.error)
            return False
        self._to(S.RUNNING)
        self._settle(self.kv_future, done)
        return True

    def fail(self, engine: LLMEngine, receiver: Receiver, error: BaseException, *, refused: bool = False,
             peer_gone: bool = False) -> bool:
        """-> FAILED, then RELEASED or QUARANTINED by the page rule (module doc). Idempotent once failed.

        Args:
            error: what the handler (and so the client) gets.
            refused: the prefill worker answered before pushing anything (400/409): withdraw the ticket.
            peer_gone: the prefill worker is unreachable: fail every transfer from it (`Receiver.peer_failed`).

        Returns:
            False when the request had already failed (nothing done).

        Raises:
            IllegalTransition: the request is RUNNING (abort it in the engine instead).
        """
        if self.state in (S.FAILED, S.QUARANTINED, S.RELEASED):
            return False
        if self.state is S.RUNNING:
            raise IllegalTransition(f"request {self.request_id}: cannot fail a running request")
        if self.state is S.QUEUED:  # no pages yet
            self._fail_now(engine, error)
            return True
        if self.state is S.RESERVED:  # the ticket never left: nothing was or will be written
            refused = True
        if refused:
            try:
                receiver.withdraw(self.transfer_id)
            except ValueError:  # a push did arrive: the sender did accept it and may still write
                refused = False
            else:
                self._fail_now(engine, error)
                return True
        if peer_gone:
            receiver.peer_failed(self.prefill_agent, str(error))
        else:
            receiver.abort(self.transfer_id, str(error))
        self._quarantine(engine, error)
        return True

    def on_transfer_failed(self, engine: LLMEngine, error: BaseException) -> None:
        """The receiver reports the transfer failed (deadline, protocol error, the sender stopped, peer died):
        -> FAILED -> QUARANTINED until its `PagesReleased`. An echo of our own failure is ignored."""
        if self.state in (S.FAILED, S.QUARANTINED, S.RELEASED):
            return
        if self.state is S.RESERVED:  # only a sender that got the ticket can fail it
            self._to(S.ARRIVING)
        if self.state is not S.ARRIVING:
            raise IllegalTransition(f"request {self.request_id}: transfer failed while {self.state.value}")
        self._quarantine(engine, error)

    def on_pages_released(self, engine: LLMEngine, rel: PagesReleased) -> None:
        """QUARANTINED -> RELEASED: the receiver says nothing writes into the pages any more; free them."""
        self._to(S.RELEASED)
        engine.release_request(self.request_id)
        logger.debug("request %s: %d pages released (%s)", self.request_id, len(rel.pages), rel.why)

    # ---- internals -----------------------------------------------------------------------------------
    def _fail_now(self, engine: LLMEngine, error: BaseException) -> None:
        """FAILED -> RELEASED: no WRITE can come; the engine frees the pages with the request."""
        self._to(S.FAILED)
        self.error = error
        engine.abort_request(self.request_id, release_pages=True)
        self._to(S.RELEASED)
        self._settle_failure(error)

    def _quarantine(self, engine: LLMEngine, error: BaseException) -> None:
        """FAILED -> QUARANTINED: the engine ends the request but holds its pages for `on_pages_released`."""
        self._to(S.FAILED)
        self.error = error
        engine.abort_request(self.request_id, release_pages=False)
        self._to(S.QUARANTINED)
        self._settle_failure(error)

    def _settle_failure(self, error: BaseException) -> None:
        self._settle(self.ticket_future, error=error)
        self._settle(self.kv_future, error=error)
