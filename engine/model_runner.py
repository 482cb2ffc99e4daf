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

from pd_cluster.engine.block_tables import BlockTableRows
from pd_cluster.engine.executor.tp import TPDriver
from pd_cluster.engine.executor.shard import Shard
from pd_cluster.engine.packed_step import HEADER_LEN, pack_step
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
        self.rows = BlockTableRows()  # which row of every rank's device block table each running request owns

    def release(self, request_id: str) -> None:
        """Hook: the request left the running set (finished, aborted, retracted, handed off); its block-table row
        is free again. The engine wires it to `Scheduler.on_leave`. Unknown ids are ignored."""
        self.rows.release(request_id)

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

    def _forward(self, step: np.ndarray) -> torch.Tensor:
        """Run the packed step (`pd_cluster.engine.packed_step`) on every rank; rank 0's logits."""
        if self.tp_driver is not None:
            return self.tp_driver.run_step(step)
        return self.shard.run_step(step[:HEADER_LEN], step[HEADER_LEN:])

    def _build_batch(self, items: list[ScheduledRequest], num_decodes: int
                     ) -> tuple[np.ndarray, list[int], list[tuple[Request, int, int, int]]]:
        """The packed step ([HEADER_LEN + payload] int64), the sampled requests' logits rows, and the prompt
        logprob rows. Block tables travel as appends to the requests' persistent rows (`BlockTableRows`)."""
        token_ids: list[int] = []
        starts, qlens, logits = [], [], []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (req, first logits row, first position, count)
        n_tok = 0
        for it in items:
            req = it.req
            n = it.num_new_tokens
            if n == 1:
                token_ids.append(req.token_ids[it.start])
            else:
                token_ids.extend(req.token_ids[it.start:it.end])
            starts.append(it.start)
            qlens.append(n)
            lp_count = self._prompt_logprob_count(it)
            if lp_count:
                prompt_rows.append((req, len(logits), it.start, lp_count))
                logits.extend(range(n_tok, n_tok + lp_count))
            if it.samples:
                if lp_count != n:
                    logits.append(n_tok + n - 1)
                sample_rows.append(len(logits) - 1)
            n_tok += n
        rows, edits = self.rows.step([it.req.request_id for it in items], [it.req.block_table for it in items])
        step = pack_step(token_ids, starts, qlens, rows, logits, num_decodes, edits)
        return step, sample_rows, prompt_rows

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
