"""Overlap scheduling: schedule and issue step N+1 while step N runs on the device.

The engine thread's host work (scheduling, building the batch, reading
tokens back, detokenizing, stop checks) otherwise sits between two device
steps, leaving the GPU idle for it. As SGLang's overlap scheduler and vLLM
v1's async scheduling do, `LLMEngine.step` schedules and issues step N+1
first, then waits for step N's tokens and applies them; `OverlapState` holds
the step in flight between two calls:

- A decode of step N+1 whose input is the token step N is still sampling
  reads it on the device (`PendingSample.token_ids`, SGLang's future token
  ids); the request counts it in ``num_inflight`` until it is known.
- ``num_computed_tokens`` advances when a step is issued; its pages join the
  prefix cache when it completes (`Scheduler.on_step_done`).
- A request that a token of step N stops (EOS, stop id, stop string) has run
  one more step in N+1; that token is dropped. One whose last token by
  ``max_tokens`` is in flight is not scheduled again.
- Before a step with a request whose sampling needs its previous token on the
  host (a structured-output matcher, penalties, logits processors), the
  engine first completes the step in flight: such steps do not overlap.
- Pages freed while a step is in flight (abort, retraction) are written by
  that step only; any later user's writes come after it on the same stream.
  The decode role hands pages reserved by a schedule to a transfer after
  `step` returns: the step issued with that schedule does not write them
  (they were free) and every earlier step has completed by then.

Off CUDA, torch runs each op before returning, so nothing overlaps; the
bookkeeping is the same and is tested there (``--enable-overlap-schedule``).
Under tensor parallelism the packed step names its future tokens and rank 0
broadcasts the sampled ids on the device group (NCCL: queued on each rank's
stream). Not for the prefill role, whose steps hand pages to transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.engine.config import EngineConfig
from pd_cluster.engine.model_runner import LaunchedStep
from pd_cluster.engine.request import Request


def overlap_mode(config: EngineConfig, device_type: str) -> tuple[bool, str]:
    """Whether an engine overlaps scheduling, and why (for the start-up log)."""
    dc = config.device
    if dc.disable_overlap_schedule:
        return False, "off (--disable-overlap-schedule)"
    if config.role == "prefill":
        return False, "off (prefill role)"
    if config.speculative.enabled:
        return False, "off (speculative decoding verifies on the host)"
    if device_type == "cuda":
        return True, "on"
    if dc.enable_overlap_schedule:
        return True, "on (--enable-overlap-schedule)"
    return False, "off (no CUDA)"


def needs_host_tokens(req: Request) -> bool:
    """Whether `req`'s next sampling reads its previous tokens on the host."""
    p = req.params
    return req.grammar is not None or p.has_penalties or bool(p.logits_processors)


@dataclass
class OverlapState:
    """An engine's overlap scheduling: on or off, and the step in flight between two `LLMEngine.step` calls.

    Attributes:
        enabled: steps overlap (`overlap_mode`).
        reason: ``on``, or ``off`` with the reason, as the start-up log line shows it.
        in_flight: the step issued by the last `LLMEngine.step` whose tokens are not applied yet.
        num_drains: steps that waited for the previous one first (a request needed host tokens).
        num_overlapped: steps issued while the previous one was in flight.
    """

    enabled: bool
    reason: str
    in_flight: LaunchedStep | None = None
    num_drains: int = 0
    num_overlapped: int = 0

    def describe(self) -> str:
        """``on``, or ``off`` with the reason, as the start-up log line shows it."""
        return self.reason
