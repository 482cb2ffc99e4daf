"""What the scheduler decided for one step: each request's share (`ScheduledRequest`) and the step's whole plan
(`SchedulerOutput`), which the model runner runs and the engine reports (vLLM v1's ``SchedulerOutput``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)``.

    A speculative verify (`draft` not empty) computes the last known token and then the draft tokens, which are
    not the request's tokens until verification accepts them (`Scheduler.on_verified`).
    """

    req: Request
    start: int
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def known_end(self) -> int:
        """The end of the tokens known before the step (drafts excluded)."""
        return self.end - len(self.draft)

    @property
    def samples(self) -> bool:
        """True when this step computes the last known token, so the next one is sampled."""
        return self.known_end == self.req.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs. Decodes come first, then speculative verifies, then prefill chunks."""

    decodes: list[ScheduledRequest] = field(default_factory=list)
    verifies: list[ScheduledRequest] = field(default_factory=list)  # speculative: last token + drafts, one extend
    prefills: list[ScheduledRequest] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    recomputed: list[Request] = field(default_factory=list)  # longrope: KV of the short factors, now too long
    reserved: list[Request] = field(default_factory=list)  # decode role: pages just reserved
    local_prefills: list[Request] = field(default_factory=list)  # decode role: remote requests prefilled here
    num_cached_tokens: int = 0       # prompt tokens found in the prefix cache by the requests admitted this step
    prefix_cache_queries: int = 0    # tokens looked up in the prefix cache (first admissions only, as vLLM)
    prefix_cache_hits: int = 0       # of which found on the device
    host_cache_queries: int = 0      # the same lookups, counted when a host tier is on (vLLM's external_*)
    host_cache_hits: int = 0         # of which loaded back from the host tier or read from the KV store
    storage_cache_hits: int = 0      # of those, read from the cluster-wide KV store
    reserved_cached_tokens: int = 0  # decode role: of the reserved requests' tokens, those their cache held
    launched: bool = False           # `Scheduler.on_step_launched` ran (admission updates applied)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.decodes + self.verifies + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.verifies and not self.prefills

