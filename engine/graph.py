"""CUDA graphs for decode steps: all graph logic of the engine lives in this module.

The design is mini-sglang's and nano-vllm's: decode batches are padded up to a
fixed set of batch sizes (buckets ``1, 2, 4, 8, 16, 32, ...`` up to
``--cuda-graph-max-bs``); one graph per bucket is captured, largest first, into
one shared memory pool (smaller graphs reuse the largest one's blocks). The
graphs read their inputs from static buffers (`CaptureBuffers`) allocated
once at the largest size; a step copies its batch into the first rows and pads
the rest with the sentinels that make padding inert: slot ``-1`` (the store
kernel skips it), block-table rows of the null page 0, ``seq_len`` 1, position
0. The attention backend gets `prepare_for_capture` before the first capture
(static workspaces) and `prepare_for_replay` before each replay; it must
compute everything a decode step needs on the device (the Triton backend
does), since a graph replays no host code. Replay issues device-to-device
copies and one graph launch: no host sync.

Before `capture`, `CudaGraphRunner.replay` runs the padded static batch
eagerly, which is how the padding logic is tested without a GPU.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import ForwardBatch, build_forward_batch
from pd_cluster.engine.kv.pool import KVPool

logger = logging.getLogger(__name__)

GRAPH_TABLE_BYTES = 64 << 20  # the decode graphs' static block table: at most this many bytes
PAD_SEQ_LEN = 1  # a padded request "attends" to token 0 of the null page, whose output row is ignored


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The buckets for `max_bs`: 1, 2, 4, 8, then every multiple of 16, then `max_bs` itself (sorted).

    Raises:
        ValueError: `max_bs` < 1.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = {bs for bs in (1, 2, 4, 8) if bs <= max_bs} | set(range(16, max_bs + 1, 16)) | {max_bs}
    return sorted(sizes)


def select_bucket(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `num_reqs` requests, or None if none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class CaptureBuffers:
    """Static inputs of the decode graphs, allocated once for `max_bs` requests.

    Attributes:
        input_ids, positions, slot_mapping: [max_bs] int64.
        seq_lens: [max_bs] int32; query_start_loc: [max_bs + 1] int32 (``0..max_bs``, fixed).
        block_tables: [max_bs, max_pages] int32.
        logits_indices: [max_bs] int64.
        group_slots, group_tables: with KV cache groups (`pd_cluster.engine.kv.groups`), groups 1..G's
            slot mappings ([max_bs] int64 each) and block tables ([max_bs, max_pages] int32 each); empty with one.
        rope_variant: [max_bs] int64, each request's longrope factor set (`ForwardBatch.rope_variant`; 0 when the
            batch has none).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    group_slots: tuple[torch.Tensor, ...] = ()
    group_tables: tuple[torch.Tensor, ...] = ()
    rope_variant: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_bs: int, max_pages: int, device: torch.device, num_groups: int = 1) -> "CaptureBuffers":
        def longs() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        bufs = cls(
            input_ids=longs(), positions=longs(), slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64,
                                                                          device=device),
            seq_lens=torch.full((max_bs,), PAD_SEQ_LEN, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
            logits_indices=torch.arange(max_bs, dtype=torch.int64, device=device),
            group_slots=tuple(torch.full((max_bs,), -1, dtype=torch.int64, device=device)
                              for _ in range(num_groups - 1)),
            group_tables=tuple(torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
                               for _ in range(num_groups - 1)),
            rope_variant=longs(),
        )
        return bufs

    @property
    def max_bs(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    def fill(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a decode-only `batch` into rows ``[:n]`` and pad rows ``[n:bs]`` (device copies only).

        Raises:
            ValueError: the batch is not decode-only, or does not fit `bs` rows / `max_pages` pages.
        """
        n = batch.num_reqs
        if not batch.is_decode_only or n > bs or bs > self.max_bs:
            raise ValueError(f"need a decode-only batch of at most {bs} <= {self.max_bs} requests, got {n} "
                             f"({batch.num_decodes} decodes)")
        width = batch.block_tables.shape[1]
        if width > self.max_pages:
            raise ValueError(f"block table of {width} pages exceeds the captured {self.max_pages}")
        groups = batch.group_batches or ()
        if len(groups) != len(self.group_tables):
            raise ValueError(f"the batch has {len(groups) + 1} KV groups, the buffers {len(self.group_tables) + 1}")
        for g, slots, table in zip(groups, self.group_slots, self.group_tables):
            w = g.block_tables.shape[1]
            if w > self.max_pages:
                raise ValueError(f"block table of {w} pages exceeds the captured {self.max_pages}")
            slots[:n].copy_(g.slot_mapping)
            table[:n, :w].copy_(g.block_tables)
            if bs > n:
                slots[n:bs].fill_(-1)
                table[n:bs].zero_()
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if batch.rope_variant is not None:
            self.rope_variant[:n].copy_(batch.rope_variant)
        else:
            self.rope_variant[:n].zero_()
        num_logits = batch.logits_indices.shape[0]
        self.logits_indices[:num_logits].copy_(batch.logits_indices)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(PAD_SEQ_LEN)
            self.block_tables[n:bs].zero_()
            self.rope_variant[n:bs].zero_()
        if bs > num_logits:
            self.logits_indices[num_logits:bs].copy_(self.query_start_loc[num_logits:bs])

    def batch_view(self, bs: int) -> ForwardBatch:
        """A decode `ForwardBatch` over the first `bs` rows.

        Its host lists are placeholders (every request 1 token, ``seq_len`` 1):
        what runs inside a graph must read lengths from the device tensors.
        """
        batch = ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], logits_indices=self.logits_indices[:bs], num_decodes=bs,
            query_lens_cpu=[1] * bs, seq_lens_cpu=[PAD_SEQ_LEN] * bs, query_start_loc_cpu=list(range(bs + 1)),
            rope_variant=self.rope_variant[:bs],
        )
        if self.group_tables:
            batch.group_batches = tuple(dataclasses.replace(batch, slot_mapping=slots[:bs], block_tables=table[:bs])
                                        for slots, table in zip(self.group_slots, self.group_tables))
        return batch


@dataclass(frozen=True)
class CudaGraphConfig:
    """Decode-graph settings (SGLang flag names).

    Attributes:
        max_bs: ``--cuda-graph-max-bs``, the largest captured decode batch.
        max_context_len: the longest context the captured graphs serve: their static block table is
            [max_bs, max_context_len / page_size] int32. None (the default): as many pages as the pool holds
            (no request can hold more), within `GRAPH_TABLE_BYTES` (`graph_table_pages`); deliberately not the
            engine's ``--context-length``, so memory never scales with it. A decode batch whose table is wider
            runs eagerly (`CudaGraphRunner.can_run`).
        disable: ``--disable-cuda-graph``.
        eager_stand_in: off CUDA, still build the runner, uncaptured: its replay runs the padded
            static batch eagerly. This is how the buckets, padding and (under TP) the
            every-rank bookkeeping are tested without a GPU; no server sets it.
    """

    max_bs: int = 256
    max_context_len: int | None = None
    disable: bool = False
    eager_stand_in: bool = False

    def __post_init__(self) -> None:
        if self.max_bs < 1 or (self.max_context_len is not None and self.max_context_len < 1):
            raise ValueError(f"max_bs and max_context_len must be >= 1, got {self.max_bs}, {self.max_context_len}")


def graph_table_pages(max_bs: int, num_pages: int) -> int:
    """Width (pages) of the decode graphs' static block table [max_bs, width] int32: every page of the pool
    (no request holds more), capped so the table takes at most `GRAPH_TABLE_BYTES` (64 MiB: 65,536 pages at
    256 requests, i.e. 1M tokens at page size 16 and 64k at page size 1)."""
    return max(1, min(num_pages, GRAPH_TABLE_BYTES // (4 * max_bs)))


class CudaGraphRunner:
    """Captures and replays decode steps (see the module docstring).

    Args:
        model: a module with ``forward(batch, pool, backend) -> logits``.
        pool: the KV pool; backend: an attention backend with ``supports_cuda_graph``.
        config: buckets and block-table width.

    Raises:
        ValueError: the backend cannot run inside a graph.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, backend: AttentionBackend,
                 config: CudaGraphConfig) -> None:
        if not getattr(backend, "supports_cuda_graph", False):
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in a CUDA graph "
                             "(it reads host-side lengths); use --attention-backend triton or --disable-cuda-graph")
        self.model, self.pool, self.backend, self.config = model, pool, backend, config
        self.device = pool.device
        self.sizes = capture_batch_sizes(config.max_bs)
        if config.max_context_len is None:
            max_pages = graph_table_pages(config.max_bs, pool.num_pages)
        else:
            max_pages = -(-config.max_context_len // pool.page_size)
        self.buffers = CaptureBuffers.allocate(config.max_bs, max_pages, self.device, pool.groups.num_groups)
        backend.prepare_for_capture(config.max_bs, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.mempool = None
        self.replays = 0  # decode steps served by this runner (graph replays, or eager stand-in runs)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a decode-only batch that fits the largest bucket and the captured block-table width.

        A wider batch (a context past `CudaGraphConfig.max_context_len`) runs eagerly: there is no re-capture,
        since at such lengths attention, not launch overhead, dominates a decode step."""
        return (batch.num_reqs > 0 and batch.is_decode_only and batch.num_reqs <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.buffers.max_pages
                and all(g.block_tables.shape[1] <= self.buffers.max_pages for g in batch.group_batches or ()))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, into one memory pool (CUDA only).

        Raises:
            RuntimeError: the pool is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        logger.info("Capture cuda graph begin. This can take up to several minutes. avail mem=%.2f GB",
                    free_before / 2**30)
        self.mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):
            batch = self._pad_to(bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
                    self.model(batch, self.pool, self.backend)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool, stream=stream):
                self.outputs[bs] = self.model(batch, self.pool, self.backend)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        free_after = torch.cuda.mem_get_info(self.device)[0]
        logger.info("Capture cuda graph end. Time elapsed: %.2f s. mem usage=%.2f GB. avail mem=%.2f GB. bs=%s",
                    time.perf_counter() - start, (free_before - free_after) / 2**30, free_after / 2**30, self.sizes)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[len(batch.logits_indices), vocab]`` of a decode step, by graph replay.

        The result is a view of the graph's static output: consume it before the
        next replay. Without captured graphs the padded static batch runs
        eagerly (same numbers, no graph).

        Raises:
            ValueError: `can_run(batch)` is false.
        """
        if not self.can_run(batch):
            raise ValueError("batch cannot use the decode graphs (not decode-only, too large, or too long)")
        bs = select_bucket(batch.num_reqs, self.sizes)
        self.buffers.fill(batch, bs)
        self.replays += 1
        num_logits = batch.logits_indices.shape[0]
        if bs in self.graphs:
            view = self.buffers.batch_view(bs)
            self.backend.prepare_for_replay(view)
            self.graphs[bs].replay()
            return self.outputs[bs][:num_logits]
        return self.model(self.buffers.batch_view(bs), self.pool, self.backend)[:num_logits]

    def _pad_to(self, bs: int) -> ForwardBatch:
        """The static batch of `bs` padded requests, as captured."""
        self.buffers.input_ids[:bs].zero_()
        self.buffers.positions[:bs].zero_()
        self.buffers.slot_mapping[:bs].fill_(-1)
        self.buffers.seq_lens[:bs].fill_(PAD_SEQ_LEN)
        self.buffers.block_tables[:bs].zero_()
        for slots, table in zip(self.buffers.group_slots, self.buffers.group_tables):
            slots[:bs].fill_(-1)
            table[:bs].zero_()
        self.buffers.logits_indices[:bs].copy_(self.buffers.query_start_loc[:bs])
        return self.buffers.batch_view(bs)


@torch.inference_mode()
def warm_up_kernels(model: torch.nn.Module, pool: KVPool, backend: AttentionBackend) -> None:
    """Run one eager step that launches every kernel the server uses, so each compiles at start-up.

    The step holds one decode request and one two-token prefill chunk, both on
    the null page with slot ``-1`` (nothing is stored; the outputs are
    discarded): store, decode, extend, every norm (with and without a
    residual), RoPE and the activation launch once per layer. The kernels take
    runtime-varying integers as ``do_not_specialize`` and everything else is
    fixed by the model and pool, so this step compiles the only variants a
    serving step can ask for (`pd_cluster.engine.attention.triton.variants`;
    tests/kernels/test_kernel_variants.py proves it). CUDA-graph capture
    (`CudaGraphRunner.capture`) then compiles nothing new. Modules with a ``warm_up_kernels`` method (MoE
    blocks: the expert kernels' large-batch tiles) run it after the step.
    """
    page = pool.page_size
    null_pages = [0] * -(-2 // page)
    batch = build_forward_batch([np.zeros(1, dtype=np.int64), np.zeros(2, dtype=np.int64)], [1, 0],
                                [null_pages, null_pages], [np.array([0]), np.array([1])], 1, page, pool.device)
    batch = dataclasses.replace(batch, slot_mapping=torch.full_like(batch.slot_mapping, -1))
    model(batch, pool, backend)
    for module in model.modules():
        if hasattr(module, "warm_up_kernels"):
            module.warm_up_kernels()
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)


def maybe_capture_decode_graphs(model: torch.nn.Module, pool: KVPool, backend: AttentionBackend,
                                config: CudaGraphConfig) -> CudaGraphRunner | None:
    """The engine's entry point: a captured `CudaGraphRunner`, or None when graphs do not apply.

    None when ``--disable-cuda-graph`` is set, the pool is not on a CUDA device
    (unless `CudaGraphConfig.eager_stand_in`: then an uncaptured runner), or the
    backend cannot be captured (logged). Under tensor parallelism every rank
    calls this with the same config (`TPDriver.capture_decode_graphs`), so all
    capture the same buckets in the same order and their all-reduces line up.
    """
    if config.disable or (pool.device.type != "cuda" and not config.eager_stand_in):
        return None
    if not getattr(backend, "supports_cuda_graph", False):
        logger.warning("CUDA graphs disabled: attention backend %r cannot be captured", backend.name)
        return None
    if getattr(model, "has_recurrent_state", False):
        logger.warning("CUDA graphs disabled: the model's linear-attention layers are not captured")
        return None
    runner = CudaGraphRunner(model, pool, backend, config)
    if pool.device.type == "cuda":
        runner.capture()
    return runner
