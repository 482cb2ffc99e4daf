"""Engine counters and the SGLang-style periodic log lines.

``Prefill batch. #new-seq: …, #new-token: …, #cached-token: …, token usage: …, #running-req: …, #queue-req: …``
``Decode batch. #running-req: …, #token: …, token usage: …, gen throughput (token/s): …, #queue-req: …``
(with speculative decoding ``accept len: …`` after ``token usage``: tokens emitted per decoding request and step)
``Prealloc batch. #new-seq: …, #new-token: …, #cached-token: …, token usage: …, #running-req: …, #queue-req: …``
(decode role: remote requests whose pages were reserved this step; ``#new-token`` are the prompt tokens to
receive, ``#cached-token`` those this worker's prefix cache held, which are not transferred)
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from pd_cluster.engine.scheduler.output import SchedulerOutput
from pd_cluster.engine.scheduler.scheduler import Scheduler
from pd_cluster.engine.spec.stats import SpecDecodeStats

logger = logging.getLogger("engine")


class EngineStats:
    """Totals since start plus the numbers behind the periodic log lines.

    Args:
        decode_log_interval: decode steps between two ``Decode batch.`` lines.

    Attributes:
        prompt_tokens_total: prompt tokens computed (cached ones are not).
        generation_tokens_total: tokens sampled.
        prefix_cache_queries: prompt tokens looked up in the prefix cache, at each request's
            first admission (vLLM's ``prefix_cache_queries``; 0 while the cache is off).
        prefix_cache_hits: of those, tokens found cached on the device (vLLM's ``prefix_cache_hits``).
        external_prefix_cache_queries: the same lookups while the host tier is on (vLLM's
            ``external_prefix_cache_queries``, which counts its CPU-offload tier there).
        external_prefix_cache_hits: of those, tokens loaded back from the host tier or read from the
            cluster-wide KV store (vLLM counts every connector tier there).
        storage_cache_hits: of those, tokens read from the KV store (SGLang's ``cached_tokens{cache_source=
            "storage"}``).
        cached_tokens_total: tokens served from the cache, retracted requests' re-admissions included.
    """

    def __init__(self, decode_log_interval: int, spec: SpecDecodeStats | None = None) -> None:
        self.decode_log_interval = decode_log_interval
        self.spec = spec  # speculative decoding's counters, None when it is off
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.storage_cache_hits = 0
        self.cached_tokens_total = 0
        self.finished: Counter[str] = Counter()
        self.gen_throughput = 0.0
        self._decode_steps = 0
        self._interval_tokens = 0
        self._interval_start = time.monotonic()

    def on_step(self, out: SchedulerOutput, scheduler: Scheduler, num_sampled: int) -> None:
        """Account for one step and log when due."""
        new_prompt = sum(min(p.end, p.req.num_prompt_tokens) - min(p.start, p.req.num_prompt_tokens)
                         for p in out.prefills)
        self.prompt_tokens_total += new_prompt
        self.generation_tokens_total += num_sampled
        self.prefix_cache_queries += out.prefix_cache_queries
        self.prefix_cache_hits += out.prefix_cache_hits
        self.external_prefix_cache_queries += out.host_cache_queries
        self.external_prefix_cache_hits += out.host_cache_hits
        self.storage_cache_hits += out.storage_cache_hits
        self.cached_tokens_total += out.num_cached_tokens
        self._interval_tokens += num_sampled
        if out.retracted:
            logger.warning("KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f",
                           len(out.retracted), scheduler.admission.new_token_ratio)
        held = out.reserved_cached_tokens  # decode role: matched before the transfer
        if out.prefills:
            logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#running-req: %d, #queue-req: %d", len(out.prefills), new_prompt,
                        out.num_cached_tokens - held, scheduler.pages.token_usage, len(scheduler.running),
                        len(scheduler.waiting))
        if out.reserved:
            logger.info("Prealloc batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#running-req: %d, #queue-req: %d", len(out.reserved),
                        sum(r.num_prompt_tokens for r in out.reserved) - held, held, scheduler.pages.token_usage,
                        len(scheduler.running), len(scheduler.waiting))
        if self.spec is not None:
            self.spec.on_plain_decodes(len(out.decodes))
        if out.decodes or out.verifies:
            self._decode_steps += 1
            if self._decode_steps % self.decode_log_interval == 0:
                self._log_decode(scheduler)

    def _log_decode(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        self.gen_throughput = self._interval_tokens / max(now - self._interval_start, 1e-9)
        self._interval_tokens, self._interval_start = 0, now
        num_tokens = sum(r.num_computed_tokens for r in scheduler.running)
        spec = "" if self.spec is None else f"accept len: {self.spec.take_accept_length():.2f}, "
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): %.2f, "
                    "#queue-req: %d", len(scheduler.running), num_tokens, scheduler.pages.token_usage, spec,
                    self.gen_throughput, len(scheduler.waiting))
