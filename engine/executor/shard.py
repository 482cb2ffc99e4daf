"""What one rank holds: its model shard, its KV pool (its share of the KV heads), its attention backend.

Rank 0 builds its `Shard` inside `LLMEngine`; every other rank builds the same
in its own process (`pd_cluster.engine.executor.tp`). The pool size is the smallest
any rank can hold, so page ids mean the same slot on every rank and one page
allocator (rank 0's) serves them all.
"""

from __future__ import annotations

import dataclasses

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pd_cluster.engine.attention import get_backend, resolve_backend_name
from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import HostStaging
from pd_cluster.engine.block_tables import DeviceBlockTable
from pd_cluster.engine.config import EngineConfig
from pd_cluster.engine.device_copy import to_device
from pd_cluster.engine.graph import CudaGraphConfig, maybe_capture_decode_graphs, warm_up_kernels
from pd_cluster.engine.kv.groups import KVGroups, plan_kv_groups, single_group
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.kv.sizing import PoolPlan, plan_pool
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.eplb import ExpertBalancer, setup_eplb
from pd_cluster.engine.model.layer_ops import layer_ops
from pd_cluster.engine.model.loader import LoadedModel, load_model
from pd_cluster.engine.packed_step import build_step, unpack_step
from pd_cluster.engine.parallel.context_parallel import ContextParallel
from pd_cluster.engine.parallel.group import TPGroup

logger = logging.getLogger(__name__)

_KV_DTYPE_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Shard:
    """One rank's model execution state."""

    loaded: LoadedModel
    layout: KVLayout
    plan: PoolPlan
    pool: KVPool
    backend: AttentionBackend
    backend_name: str
    graph_runner: Any = None
    staging: HostStaging | None = None  # persistent host buffers for the step's inputs (set by build_shard)
    block_table: DeviceBlockTable | None = None  # persistent per-request rows of page ids (set by build_shard)
    cp: Any = None  # this rank's `ContextParallel` runner under --prefill-context-parallel-size > 1, else None
    eplb: ExpertBalancer | None = None  # EPLB's placement and load counts (`pd_cluster.engine.model.eplb`), or None

    @property
    def _state_pages(self) -> dict[int, int]:
        """The pool's state group and its pages per request (`build_step`), empty without one."""
        g = self.pool.groups.state_group
        return {} if g is None else {g: self.pool.groups.groups[g].rule[1]}

    def capture_decode_graphs(self, config: CudaGraphConfig) -> list[int]:
        """Capture this rank's decode CUDA graphs once the pool exists (none off CUDA or with
        ``--disable-cuda-graph``); returns the captured batch sizes, [] for none. The shard owns its runner
        (its static buffers hold every KV group's block table and slot mapping)."""
        self.graph_runner = maybe_capture_decode_graphs(self.loaded.model, self.pool, self.backend, config)
        if self.eplb is not None:
            self.eplb.reset_counts()  # capture's warm-up passes routed dummy tokens
        return [] if self.graph_runner is None else list(self.graph_runner.sizes)

    def run_step(self, header: np.ndarray, payload: np.ndarray, prev_tokens: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Run one packed step (`pd_cluster.engine.packed_step`; header [HEADER_LEN] and payload int64 numpy
        arrays): apply its block-table edits, build its `ForwardBatch`, run the model. Every rank, rank 0
        included, runs exactly this. Returns the logits [L, vocab].

        Args:
            prev_tokens: overlap scheduling: the previous step's sampled ids ([P] int64 on this device); the
                step's future token positions take their ids from it, on the device.

        Raises:
            ValueError: the step has future tokens but `prev_tokens` is missing or not of its size P.
        """
        step = unpack_step(header, payload)
        batch = build_step(step, self.block_table, self.pool.page_size, self.staging, self._state_pages)
        if step.future_pos.size:
            if prev_tokens is None or prev_tokens.numel() != step.num_prev:
                raise ValueError(f"the step takes {step.future_pos.size} input ids from the previous step's "
                                 f"{step.num_prev} sampled ids, got {None if prev_tokens is None else prev_tokens.shape}")
            dev = batch.input_ids.device
            batch.input_ids[to_device(step.future_pos, dev)] = prev_tokens[to_device(step.future_src, dev)]
        logits = self.forward(batch)
        if self.eplb is not None and not self.eplb.group.gathers_tokens:  # TP: every rank runs every step
            self.eplb.step_done()  # (DP attention counts its lockstep's steps: `DPMoEGroup.end_step`)
        return logits

    def forward(self, batch) -> torch.Tensor:
        """Run the model on `batch` (a `ForwardBatch` on this rank's device)."""
        if self.cp is not None and self.cp.applies(batch):
            return self.cp.forward(self.loaded.model, batch, self.pool, self.backend)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        return self.loaded.model(batch, self.pool, self.backend)


def check_tp_size(model_path: str, tp_size: int, expert_parallel: bool = False, num_redundant_experts: int = 0
                  ) -> None:
    """Refuse a TP size that does not divide the KV heads (MLA: the attention heads), the MLP width or the
    experts (before any rank starts).

    Raises:
        ValueError: naming the sizes (`ArchConfig.check_tp`).
    """
    ArchConfig.from_pretrained(model_path).check_tp(tp_size, expert_parallel, num_redundant_experts)


def kv_groups(config: EngineConfig, arch: ArchConfig) -> KVGroups:
    """The pool's KV groups (`pd_cluster.engine.kv.groups`): by attention type for a model with sliding-window
    or chunked layers, in every role, unless ``--disable-hybrid-kv-cache-manager``; one group otherwise (an MLA
    or hierarchical-cache pool is all-full or keeps every page). A prefill and a decode worker compare their
    groups at the KV transfer handshake (`KVLayout.kv_groups`)."""
    layers = arch.layer_attention
    if arch.linear_attention_layers:
        _check_state_model(config, arch)
        return plan_kv_groups(layers)
    if (config.cache.disable_hybrid_kv_cache_manager or arch.mla is not None
            or config.cache.enable_hierarchical_cache or all(spec.kind == "full" for spec in layers)):
        return single_group(arch.num_hidden_layers)
    return plan_kv_groups(layers)


def _check_state_model(config: EngineConfig, arch: ArchConfig) -> None:
    """A model with linear-attention layers keeps their states in the pool's state group: refuse the settings
    that give the pool one group; its prefix cache is off (`LLMEngine`), said once here.

    Raises:
        ValueError: naming the flag.
    """
    for flag, on in (("--disable-hybrid-kv-cache-manager", config.cache.disable_hybrid_kv_cache_manager),
                     ("--enable-hierarchical-cache", config.cache.enable_hierarchical_cache)):
        if on:
            raise ValueError(f"{flag} is not built for {arch.architecture}: its linear-attention layers keep a "
                             "recurrent state per request in the KV pool's state group")
    if config.cache.enable_prefix_caching:
        logger.info("prefix caching off: the linear-attention layers' states are kept per request, not per prefix "
                    "(a cached prefix would lack them)")


def state_pages(groups: KVGroups, layout: KVLayout, arch: ArchConfig, tp: TPGroup) -> tuple[KVGroups, KVLayout]:
    """`groups` and `layout` with the state group's pages per request: one request's recurrent state on this
    rank (`LinearAttentionConfig.state_bytes`) over pages of ``layout.page_nbytes``; unchanged without one."""
    if groups.state_group is None:
        return groups, layout
    nbytes = arch.linear.state_bytes(len(arch.linear_attention_layers), tp.size)
    groups = groups.with_state(nbytes, layout.page_nbytes)
    return groups, dataclasses.replace(layout, kv_groups=groups.signature())


def kv_layout(config: EngineConfig, loaded: LoadedModel, tp: TPGroup, groups: KVGroups | None = None) -> KVLayout:
    """The pool layout of this rank (``num_kv_heads / tp_size`` heads; MLA: the whole latent on every rank,
    as vLLM and SGLang keep it: it cannot be split by heads). With `groups` other than one full group, a page
    holds one group's layers (``layers_per_page``)."""
    arch = loaded.arch
    kv_dtype = config.cache.kv_cache_dtype
    if kv_dtype == "auto":
        kv_dtype = _KV_DTYPE_OF[loaded.dtype]
    fp8 = kv_dtype == "fp8_e4m3"
    ones = (1.0,) * arch.num_hidden_layers
    if arch.mla is not None:
        return KVLayout(num_layers=arch.num_hidden_layers, num_kv_heads=1, head_dim=arch.mla.latent_dim,
                        page_size=config.cache.page_size, kv_cache_dtype=kv_dtype,
                        k_scales=tuple(loaded.k_scales) if fp8 else ones, v_scales=ones,
                        tp_size=tp.size, tp_rank=tp.rank, kv_format="mla")
    return KVLayout(num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads // tp.size,
                    head_dim=arch.head_dim, page_size=config.cache.page_size, kv_cache_dtype=kv_dtype,
                    k_scales=tuple(loaded.k_scales) if fp8 else ones, v_scales=tuple(loaded.v_scales) if fp8 else ones,
                    tp_size=tp.size, tp_rank=tp.rank,
                    layers_per_page=0 if groups is None or groups.is_single else groups.layers_per_page,
                    kv_groups=() if groups is None or groups.is_single else groups.signature())


def check_triton(device: torch.device) -> None:
    """Compile and run one tiny Triton kernel before the worker goes on (and so before it reports ready).

    Raises:
        TritonRuntimeError: Triton cannot build or launch kernels here (the message names compiler,
            ``Python.h`` and cache status).
    """
    from pd_cluster.engine.attention.triton.selfcheck import check_triton_runtime

    started = time.perf_counter()
    check_triton_runtime(device)
    logger.info("Triton self-check passed on %s in %.2f s (TRITON_CACHE_DIR=%s)", device,
                time.perf_counter() - started, os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache"))


def _mla_backend(name: str, arch: ArchConfig, tp: TPGroup):
    """The MLA backend for the resolved ``--attention-backend`` `name` (`mla_backend_name`), logged."""
    from pd_cluster.engine.attention.mla import get_mla_backend, mla_backend_name

    m = arch.mla
    logger.info("MLA attention: %s backend (attention backend %s), %d heads per rank, latent %d",
                mla_backend_name(name), name, arch.num_attention_heads // tp.size, m.latent_dim)
    return get_mla_backend(name, num_heads=arch.num_attention_heads // tp.size, kv_lora_rank=m.kv_lora_rank,
                           qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                           v_head_dim=m.v_head_dim, scale=m.softmax_scale)


def build_shard(config: EngineConfig, device: torch.device, tp: TPGroup) -> Shard:
    """Load this rank's weights, size and create its pool (agreeing on the size with the other ranks),
    and pick its attention backend.

    Raises:
        ValueError: from loading or sizing (see `load_model`, `plan_pool`).
        TritonRuntimeError: the triton backend was chosen and its self-check failed (`check_triton`).
    """
    mc = config.model
    cp = None
    if config.parallel.prefill_context_parallel_size > 1:  # every rank holds the whole model: a TP group of one
        cp, tp = ContextParallel(tp), TPGroup(0, 1, device)
    loaded = load_model(mc.path, mc.dtype, mc.load_format, mc.seed, device, tp,
                        expert_parallel=config.parallel.enable_expert_parallel)
    eplb = setup_eplb(loaded.model, tp.moe, config.parallel.eplb)  # redundant slots before the pool is sized
    if eplb is not None and tp.moe.gathers_tokens:
        tp.moe.eplb = eplb  # DP attention: its lockstep's `end_step` counts the steps
    groups = kv_groups(config, loaded.arch)
    groups, layout = state_pages(groups, kv_layout(config, loaded, tp, groups), loaded.arch, tp)
    plan = plan_pool(layout, config.cache, device)
    if tp.size > 1 or cp is not None:  # one page allocator (rank 0's) serves every rank's pool
        num_pages = (cp.group if cp is not None else tp).all_min(plan.num_pages)
        plan = PoolPlan(num_pages, plan.budget_bytes, plan.available_bytes, plan.source)
    pool = KVPool(layout, plan.num_pages, device, loaded.dtype, groups)
    arch = loaded.arch
    name = resolve_backend_name(config.device.attention_backend, device)
    if arch.mla is not None:
        backend = _mla_backend(name, arch, tp)
    else:
        backend = get_backend(name, device, num_heads=arch.num_attention_heads // tp.size,
                              num_kv_heads=layout.num_kv_heads, head_dim=arch.head_dim,
                              scale=arch.softmax_scale, layers=arch.layer_attention)
    if name == "triton":  # the GPU path: fused norm/RoPE/activation kernels beside the attention kernels
        check_triton(device)
        loaded.model.set_layer_ops(layer_ops("triton"))
        started = time.perf_counter()
        warm_up_kernels(loaded.model, pool, backend)  # every kernel variant compiles now, not while serving
        logger.info("Triton kernels warmed up in %.2f s", time.perf_counter() - started)
    return Shard(loaded, layout, plan, pool, backend, name, staging=HostStaging(device),
                 block_table=DeviceBlockTable(device), cp=cp, eplb=eplb)
