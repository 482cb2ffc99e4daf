"""The output side of the engine: each request's text, stop strings and deltas (vLLM v1's ``OutputProcessor``).

`LLMEngine` owns what the step changes: the scheduler, the runner, grammar acceptance, the stop checks on
token ids (EOS, stop ids, ``max_tokens``) and the pages. This module owns what the client sees: one
`RequestState` per request with its `IncrementalDetokenizer` (stop strings included), whether it streams,
and the `RequestDelta`s not yet handed out. The engine calls it once per accepted token and once per end;
a stop string it matches ends the request in the engine, as vLLM v1's output processor aborts the request
in its engine core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.detokenizer import IncrementalDetokenizer
from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.outputs import Logprob, RequestDelta
from pd_cluster.engine.request import Request, RequestStatus


@dataclass
class RequestState:
    """The output state of one request.

    Attributes:
        detokenizer: its text so far, held-back tails, the stop strings and how much text was sent.
        stream: a delta per token (else the text is made once, at the end, unless stop strings need it).
    """

    detokenizer: IncrementalDetokenizer
    stream: bool
    sent_prompt_logprobs: bool = False

    @property
    def needs_text_now(self) -> bool:
        """Whether each token must be detokenized as it comes (streaming, or stop strings to look for)."""
        return self.stream or bool(self.detokenizer.stop)


class OutputProcessor:
    """Turns accepted tokens into `RequestDelta`s.

    Args:
        tokenizer: the model's HF tokenizer.
        role: the engine's role (a prefill engine delivers no text of resumed output: it has none to replay).
    """

    def __init__(self, tokenizer: Any, role: str) -> None:
        self.tokenizer = tokenizer
        self.role = role
        self.states: dict[str, RequestState] = {}
        self._deltas: list[RequestDelta] = []

    def add_request(self, req: Request, stream: bool) -> None:
        """Start `req`'s output. A resumed request's output so far counts as delivered.

        Raises:
            RequestRejected: the resumed output already ends with one of its stop strings.
        """
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output,
                                       p.skip_special_tokens, p.min_tokens)
        if req.num_resumed_tokens and self.role != "prefill":  # its text was delivered already
            detok.replay(req.output_token_ids)
            if detok.stop_matched is not None:
                raise RequestRejected(f"resume_token_ids: the output already ended with the stop string "
                                      f"{detok.stop_matched!r}", param="resume_token_ids")
        self.states[req.request_id] = RequestState(detok, stream)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def match_stop_string(self, req: Request, token: int) -> str | None:
        """Detokenize `req`'s new `token` if its text is needed now; the stop string it completed, if any (the
        text is then final)."""
        state = self.states[req.request_id]
        if not state.needs_text_now:
            return None
        return state.detokenizer.add_tokens([token])

    def token(self, req: Request, token: int, logprob: Logprob | None) -> None:
        """`req` goes on after `token`: a streaming request gets its delta (text held back while it may begin a
        stop string)."""
        state = self.states[req.request_id]
        if state.stream:
            prompt_lps = None
            if req.params.prompt_logprobs is not None and not state.sent_prompt_logprobs:
                prompt_lps, state.sent_prompt_logprobs = req.prompt_logprobs, True  # complete once a token exists
            self._deltas.append(RequestDelta(
                req.request_id, [token], state.detokenizer.take_delta(False),
                [logprob] if logprob is not None else None, False, None, None, req.num_prompt_tokens,
                req.num_output_tokens, prompt_logprobs=prompt_lps, num_cached_tokens=req.num_cached_tokens or 0))

    def finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """`req` ended with `status`: its last delta carries everything not sent yet (an aborted or failed
        stream gets its remaining text but no new token)."""
        state = self.states[req.request_id]
        detok = state.detokenizer
        fresh = req.output_token_ids[req.num_resumed_tokens:]  # resumed output was delivered already
        if not state.needs_text_now:
            detok.add_all(fresh)
        detok.flush_pending()
        new_tokens = fresh[-1:] if state.stream else fresh
        if status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) and state.stream:
            new_tokens = []
        lps = req.logprobs[-len(new_tokens):] if req.logprobs and new_tokens else None
        self._deltas.append(RequestDelta(
            req.request_id, new_tokens, detok.take_delta(True), lps, True, status.value,
            req.stop_reason, req.num_prompt_tokens, req.num_output_tokens,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            times=req.times, error=error, num_cached_tokens=req.num_cached_tokens or 0))

    @property
    def has_deltas(self) -> bool:
        return bool(self._deltas)

    def take_deltas(self) -> list[RequestDelta]:
        """The deltas made since the last call, in order."""
        deltas, self._deltas = self._deltas, []
        return deltas
