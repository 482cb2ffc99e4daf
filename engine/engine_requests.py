"""The request lifecycle of `LLMEngine`: a request is queued (its prompt computed here or its KV from a prefill
worker), takes its tokens with their grammar and stop checks, and ends (finished, aborted, failed), its pages
released now or, on a prefill worker whose pushes may still read them, by `release_request`.

`RequestLifecycle` is a mixin of `LLMEngine` (`pd_cluster.engine.llm_engine`), which owns the state it works
on: the request map, the scheduler, the output processor, the KV store tier (`l3`) and the limits.
"""

from __future__ import annotations

import logging
import time
import uuid

from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.engine.request_builder import make_request
from pd_cluster.engine.sampling.params import SamplingParams

logger = logging.getLogger("engine")


class RequestLifecycle:
    """`LLMEngine`'s request methods: add, complete a remote prefill, abort, fail, release, and apply a token."""
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    stream: bool = False, resumed_output_ids: list[int] | tuple[int, ...] = ()) -> str:
        """Queue a request; returns its id.

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            stream: compute text deltas every step (else the text is made once, at the end).
            resumed_output_ids: output already generated and delivered (a migrated stream): it counts as
                output and its text is not delivered again (see `Request`).

        Raises:
            RequestRejected: invalid prompt or parameters, too long for the context or the pool.
            EngineOverloaded: the queue is full.
        """
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        req = self._make_request(request_id, ids, params, False, list(resumed_output_ids))
        self._register(req, stream)
        return req.request_id

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           stream: bool = False, resumed_output_ids: list[int] | tuple[int, ...] = ()) -> str:
        """Decode role: queue a request whose prompt KV (and resumed output's) will come from a prefill worker.

        A coming `step` reserves pages past its cached prefix (`StepOutput.reserved`) or admits it to be
        prefilled here (`StepOutput.local_prefills`). Raises as `add_request`.
        """
        req = self._make_request(request_id, list(prompt_token_ids), params, True, list(resumed_output_ids))
        self._register(req, stream)
        return req.request_id

    def _make_request(self, request_id: str | None, ids: list[int], params: SamplingParams, remote_kv: bool,
                      resumed: list[int]) -> Request:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", param="request_id")
        return make_request(self.limits, request_id, ids, params, remote_kv=remote_kv, resumed=resumed,
                            num_waiting=len(self.scheduler.waiting), sampler=self.runner.sampler,
                            grammars=self.grammars)

    def _register(self, req: Request, stream: bool) -> None:
        self.outputs.add_request(req, stream)  # raises before anything is held
        self.requests[req.request_id] = req
        if not self._prefetch(req):
            self.scheduler.add(req)

    def _prefetch(self, req: Request) -> bool:
        """Start reading `req`'s pages past this worker's cached prefix from the KV store; it joins the queue
        once read (`_admit_prefetched`). False: nothing to read."""
        if self.l3 is None or req.params.prompt_logprobs is not None:
            return False
        tokens = req.cache_tokens  # longrope's long-factor KV is keyed apart, in the store as in the cache
        cached = len(self.prefix_cache.walk(tokens, req.num_tokens - 1))
        return self.l3.prefetch(req, tokens, cached)

    def _admit_prefetched(self) -> None:
        if not self.scheduler.has_work() and self.l3.has_pending():
            self.l3.wait(0.002)  # nothing else to run: sleep on the reads rather than spin
        for req in self.l3.ready():
            if not req.status.finished:
                self.scheduler.add(req)

    def complete_remote_prefill(self, request_id: str, first_token_id: int, first_logprob=None,
                                num_cached_tokens: int = 0, prompt_logprobs=None) -> bool:
        """Decode role: the prompt's KV is in the reserved pages and prefill sampled `first_token_id`.

        `num_cached_tokens`: prompt tokens the prefill worker's cache served (this engine's own hits saved
        only their transfer); reported in ``RequestDelta.num_cached_tokens``. The arrived pages join the cache.
        `prompt_logprobs`: the prompt's logprobs computed by the prefill worker (``PromptLogprob`` list), for a
        request that asked for them; its deltas carry them as if computed here.

        A structured-output request replays the token into its fresh matcher here (`_on_token`); a token its
        grammar refuses fails the request.

        Returns False when the request is unknown or no longer waiting (e.g. aborted).
        """
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return False
        self.scheduler.complete_remote(req)
        req.num_cached_tokens = min(max(int(num_cached_tokens), 0), req.num_prompt_tokens)
        req.times.prefill_done = req.times.prefill_done or time.monotonic()
        if prompt_logprobs is not None and req.params.prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        self._on_token(req, first_token_id, first_logprob)
        return True

    def abort_request(self, request_id: str, release_pages: bool = True) -> bool:
        """Stop a request wherever it is; its final delta (``abort``) comes with the next step.

        Args:
            release_pages: free its pages now. A prefill worker whose pushes may
                still be reading them passes False and calls `release_request` later.
        """
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return False
        self._end(req, RequestStatus.FINISHED_ABORTED, release_pages)
        return True

    def fail_request(self, request_id: str, error: str) -> bool:
        """Finish one request with an error (finish_reason ``error``, `RequestDelta.error`); others go on.

        A prefill worker keeps the pages held (its pushes may still read them) until `release_request`.
        Returns False when the request is unknown or already finished.
        """
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return False
        logger.warning("request %s failed: %s", request_id, error)
        self._end(req, RequestStatus.FINISHED_ERROR, release_pages=self.role != "prefill", error=error)
        return True

    def _end(self, req: Request, status: RequestStatus, release_pages: bool, error: str | None = None) -> None:
        if self.l3 is not None:
            self.l3.discard(req.request_id)
        held = self.scheduler.remove(req, release_pages=release_pages)
        req.status = status
        req.times.finished = time.monotonic()
        self.outputs.finish(req, status, error)
        if not held:
            self._forget(req)

    def release_request(self, request_id: str) -> bool:
        """Free the pages of a held request: prefilled (prefill role) or aborted with ``release_pages=False``.

        Returns False when the request holds nothing.
        """
        req = self.scheduler.release(request_id)
        if req is None:
            return False
        self._forget(req)
        return True

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.outputs.remove(req.request_id)

    def _on_token(self, req: Request, token: int, logprob) -> None:
        if req.grammar is not None and not req.grammar.accept(token):
            self.fail_request(req.request_id, f"structured output: token {token} is not allowed by the request's "
                                              f"{req.grammar.spec.kind} constraint")
            return
        now = time.monotonic()
        req.times.first_token = req.times.first_token or now
        req.times.last_token = now
        req.append_token(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        status = req.check_stop()
        if req.grammar is not None and req.grammar.is_terminated:
            status = RequestStatus.FINISHED_STOPPED
        stop_string = self.outputs.match_stop_string(req, token)
        if stop_string is not None:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = stop_string
        if status is not None:
            req.times.finished = now
            self.scheduler.finish(req, status)
            self.outputs.finish(req, status)
            if req.status != RequestStatus.PREFILLED:
                self._forget(req)
        else:
            self.outputs.token(req, token, logprob)
