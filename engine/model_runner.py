"""Runs one scheduled step: builds the `ForwardBatch`, runs the model, samples.

Owns the sampler and drives this rank's `Shard` (model, KV pool, attention
backend; nano-vllm's `ModelRunner`). CUDA-graph replay of decode batches
happens inside `Shard.forward` (`pd_cluster.engine.graph`). Under tensor parallelism each
forward is a command every rank runs (`pd_cluster.engine.executor.tp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.engine.batch import BatchInputs
from pd_cluster.engine.executor.tp import TPDriver
from pd_cluster.engine.executor.shard import Shard
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.batch import SamplingBatch
from pd_cluster.engine.sampling.sampler import Sampler, SamplerOutput, prompt_logprobs
from pd_cluster.engine.scheduler.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class StepResult:
    """Tokens sampled in a step, for the requests whose chunk reached their last known token."""

    sampled_reqs: list[Request]
    sampler_output: SamplerOutput | None


class ModelRunner:
    """Executes scheduler outputs on the model.

    Args:
        shard: this rank's model, pool and attention backend.
        device: the device of the model and pool.
        seed: seed of the sampler's shared generator.
        tp_driver: under tensor parallelism, the handle that runs each forward on every rank.
    """

    def __init__(self, shard: Shard, device: torch.device, seed: int = 0, tp_driver: TPDriver | None = None) -> None:
        self.shard = shard
        self.pool = shard.pool
        self.device = device
        self.tp_driver = tp_driver
        self.sampler = Sampler(device, seed, shard.loaded.arch.vocab_size)

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run the model on the step `out` and sample the next tokens."""
        items = out.scheduled
        inputs, sample_rows, prompt_rows = self._build_batch(items, len(out.decodes))
        logits = self._forward(inputs)
        sampled = [it.req for it in items if it.samples]
        self._record_prompt_logprobs(logits, prompt_rows)
        if not sampled:
            return StepResult([], None)
        sample_logits = logits[torch.tensor(sample_rows, device=logits.device)] if prompt_rows else logits
        result = self.sampler(sample_logits, SamplingBatch.from_requests(sampled))
        return StepResult(sampled, result)

    def _forward(self, inputs: BatchInputs) -> torch.Tensor:
        if self.tp_driver is not None:
            return self.tp_driver.call("forward", inputs)
        return self.shard.forward(inputs.build(self.device, self.shard.staging))

    def _build_batch(self, items: list[ScheduledRequest], num_decodes: int
                     ) -> tuple[BatchInputs, list[int], list[tuple[Request, int, int, int]]]:
        token_ids, starts, tables, rows = [], [], [], []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (req, first logits row, first position, count)
        n_rows = 0
        for it in items:
            req = it.req
            token_ids.append(np.asarray(req.token_ids[it.start:it.end], dtype=np.int64))
            starts.append(it.start)
            tables.append(req.block_table)
            want = []
            lp_count = self._prompt_logprob_count(it)
            if lp_count:
                want.extend(range(lp_count))
                prompt_rows.append((req, n_rows, it.start, lp_count))
            if it.samples:
                if not want or want[-1] != it.num_new_tokens - 1:
                    want.append(it.num_new_tokens - 1)
                sample_rows.append(n_rows + len(want) - 1)
            rows.append(np.asarray(want, dtype=np.int64))
            n_rows += len(want)
        return BatchInputs(token_ids, starts, tables, rows, num_decodes, self.pool.page_size), sample_rows, prompt_rows

    @staticmethod
    def _prompt_logprob_count(it: ScheduledRequest) -> int:
        """How many positions of this chunk need prompt logprobs (first pass only)."""
        req = it.req
        if req.params.prompt_logprobs is None or len(req.prompt_logprobs) != it.start:
            return 0
        return max(min(it.end, req.num_prompt_tokens - 1) - it.start, 0)

    @staticmethod
    def _record_prompt_logprobs(logits: torch.Tensor, prompt_rows: list[tuple[Request, int, int, int]]) -> None:
        for req, row, pos, count in prompt_rows:
            next_ids = req.token_ids[pos + 1: pos + 1 + count]
            req.prompt_logprobs.extend(prompt_logprobs(logits[row:row + count], next_ids, req.params.prompt_logprobs))
