"""Runs one scheduled step: builds the `ForwardBatch`, runs the model, samples.

Owns the sampler and drives this rank's `Shard` (model, KV pool, attention
backend; nano-vllm's `ModelRunner`). CUDA-graph replay of decode batches
happens inside `Shard.forward` (`pd_cluster.engine.graph`). Under tensor parallelism each
forward is a command every rank runs (`pd_cluster.engine.executor.tp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pd_cluster.engine.block_tables import BlockTableRows
from pd_cluster.engine.device_copy import to_device
from pd_cluster.engine.executor.tp import TPDriver
from pd_cluster.engine.executor.shard import Shard
from pd_cluster.engine.packed_step import HEADER_LEN, pack_step
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.batch import SamplingBatch
from pd_cluster.engine.sampling.pending import PendingSample, SamplerOutput
from pd_cluster.engine.sampling.sampler import Sampler, prompt_logprobs
from pd_cluster.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from pd_cluster.engine.spec.verify import Verified, verify_drafts


@dataclass
class StepResult:
    """Tokens sampled in a step, for the requests whose chunk reached their last known token."""

    sampled_reqs: list[Request]
    sampler_output: SamplerOutput | None
    verified: list[tuple[ScheduledRequest, Verified]] = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are issued (overlap scheduling's step in flight).

    Attributes:
        sched: what the scheduler chose.
        sampled_reqs: the requests that sample a token, in the order of ``pending``'s rows.
        pending: the sampling, on the device until `result`; None when nothing samples.
        started: when the step was scheduled (``time.monotonic``).
        verified: speculative decoding: each verify item and its verification (computed at launch; overlap
            scheduling is off with speculation).
    """

    sched: SchedulerOutput
    sampled_reqs: list[Request]
    pending: PendingSample | None
    started: float
    verified: list[tuple[ScheduledRequest, Verified]] = field(default_factory=list)

    @classmethod
    def empty(cls, sched: SchedulerOutput, started: float) -> "LaunchedStep":
        """A step that ran nothing on the device (nothing was scheduled)."""
        return cls(sched, [], None, started)

    def row_of(self) -> dict[str, int]:
        """Request id -> its row of ``pending.token_ids``."""
        return {r.request_id: i for i, r in enumerate(self.sampled_reqs)}

    def result(self) -> StepResult:
        """Wait for the device; the step's sampled tokens."""
        return StepResult(self.sampled_reqs, None if self.pending is None else self.pending.result(), self.verified)


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
        self.num_groups = shard.pool.groups.num_groups  # KV groups: one table row per request and group
        self.on_hidden = None  # NEXTN's hook: (the step's items, [T, hidden] final-norm output) after each forward

    def release(self, request_id: str) -> None:
        """Hook: the request left the running set (finished, aborted, retracted, handed off); its block-table row
        is free again. The engine wires it to `Scheduler.on_leave`. Unknown ids are ignored."""
        self.rows.release(request_id)
        for g in range(1, self.num_groups):
            self.rows.release(_group_key(request_id, g))

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None = None, started: float = 0.0) -> LaunchedStep:
        """Issue the step `out` (forward pass and sampling) without waiting for its tokens.

        Args:
            prev: the step in flight (overlap scheduling): a decode whose input token it is still sampling
                reads that token from ``prev.pending.token_ids`` on the device (SGLang's future token ids).

        Raises:
            RuntimeError: a request's input token is neither known nor sampled by `prev`.
        """
        items = out.scheduled
        inputs, sample_rows, prompt_rows, prev_tokens = self._build_batch(items, len(out.decodes), prev)
        logits = self._forward(inputs, prev_tokens)
        if self.on_hidden is not None:  # NEXTN: the target's hidden states of this step, per item
            self.on_hidden(items, self.shard.loaded.model.last_hidden)
        sampled = [it.req for it in items if it.samples and not it.draft]
        self._record_prompt_logprobs(logits, prompt_rows)
        verified = self._verify(logits, sample_rows, out.verifies)
        if not sampled:
            return LaunchedStep(out, [], None, started, verified)
        if prompt_rows or out.verifies:  # the logits hold prompt logprob or verify rows too
            logits = logits[to_device(sample_rows[:len(sampled)], logits.device)]
        return LaunchedStep(out, sampled, self.sampler.launch(logits, SamplingBatch.from_requests(sampled)),
                            started, verified)

    def _verify(self, logits: torch.Tensor, sample_rows: list[int], verifies: list[ScheduledRequest]
                ) -> list[tuple[ScheduledRequest, Verified]]:
        """Speculative decoding: verify each verify item's drafts on its rows (after the sampled rows' indices
        in `sample_rows`: one run of K + 1 rows per item, first row given)."""
        if not verifies:
            return []
        firsts = sample_rows[len(sample_rows) - len(verifies):]
        rows = [r for it, first in zip(verifies, firsts) for r in range(first, first + len(it.draft) + 1)]
        found = verify_drafts(self.sampler, logits[to_device(rows, logits.device)], [it.req for it in verifies],
                              [it.draft for it in verifies])
        return list(zip(verifies, found))

    def _forward(self, step: np.ndarray, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run the packed step (`pd_cluster.engine.packed_step`) on every rank; rank 0's logits.

        `prev_tokens`: the previous step's sampled ids on the device, for a step with future tokens."""
        if self.tp_driver is not None:
            return self.tp_driver.run_step(step, prev_tokens)
        return self.shard.run_step(step[:HEADER_LEN], step[HEADER_LEN:], prev_tokens)

    def _build_batch(self, items: list[ScheduledRequest], num_decodes: int, prev: LaunchedStep | None = None
                     ) -> tuple[np.ndarray, list[int], list[tuple[Request, int, int, int]], torch.Tensor | None]:
        """The packed step ([HEADER_LEN + payload] int64), the sampled requests' logits rows, the prompt
        logprob rows, and (overlap scheduling, when some input ids are still being sampled) `prev`'s sampled ids
        on the device.
        Block tables travel as appends to the requests' persistent rows (`BlockTableRows`).

        Raises:
            RuntimeError: a request's input token is neither known nor sampled by `prev`.
        """
        token_ids: list[int] = []
        starts, qlens, logits = [], [], []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (req, first logits row, first position, count)
        dst: list[int] = []  # overlap scheduling: input positions whose token is still on the device
        src: list[int] = []
        prev_rows = prev.row_of() if prev is not None and prev.pending is not None else {}
        n_tok = 0
        verify_firsts: list[int] = []  # speculative verifies: their first logits row
        for it in items:
            req = it.req
            n = it.num_new_tokens
            if it.draft:  # the last known token, then the drafts; logits at every one of them
                token_ids.append(req.token_ids[it.start])
                token_ids.extend(it.draft)
                starts.append(it.start)
                qlens.append(n)
                verify_firsts.append(len(logits))
                logits.extend(range(n_tok, n_tok + n))
                n_tok += n
                continue
            known = len(req.token_ids) - it.start
            if known < n:  # the last one is being sampled by `prev`
                row = prev_rows.get(req.request_id)
                if row is None or known != n - 1:
                    raise RuntimeError(f"request {req.request_id}: tokens [{it.start}, {it.end}) are not known "
                                       f"({len(req.token_ids)} known) nor sampled by the step in flight")
                token_ids.extend(req.token_ids[it.start:])
                token_ids.append(0)
                dst.append(n_tok + n - 1)
                src.append(row)
            elif n == 1:
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
        ids, tables = [it.req.request_id for it in items], [it.req.block_table for it in items]
        for g in range(1, self.num_groups):  # one more row per request for each other KV group
            ids += [_group_key(it.req.request_id, g) for it in items]
            tables += [it.req.group_tables[g - 1] for it in items]
        sample_rows += verify_firsts  # after the sampled requests' rows (`_verify`)
        rows, edits = self.rows.step(ids, tables)
        b = len(items)
        group_rows = [rows[g * b:(g + 1) * b] for g in range(1, self.num_groups)]
        prev_tokens = prev.pending.token_ids if dst else None
        step = pack_step(token_ids, starts, qlens, rows[:b], logits, num_decodes, edits, dst, src,
                         0 if prev_tokens is None else prev_tokens.numel(), group_rows,
                         [it.req.rope_variant for it in items])
        return step, sample_rows, prompt_rows, prev_tokens

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


def _group_key(request_id: str, group: int) -> str:
    """The block-table row owner of `request_id`'s KV group `group` (>= 1)."""
    return f"{request_id}\x00kv-group-{group}"
