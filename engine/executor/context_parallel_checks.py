"""Start-up refusals of ``--prefill-context-parallel-size`` (`pd_cluster.engine.parallel.context_parallel`):
what the context-parallel ranks cannot honour is refused before any rank starts, naming the flag."""

from __future__ import annotations

import torch

from pd_cluster.engine.executor.shard import kv_groups
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.parallel.context_parallel import FLAG



def check_context_parallel(config) -> None:
    """Refuse, before any rank starts, a ``--prefill-context-parallel-size`` the engine cannot honour.

    Args:
        config: the `EngineConfig`.

    Raises:
        ValueError: naming the flag: a size below 1 (`ParallelConfig`), with ``--tp-size`` above 1, in the
            decode role, with speculative decoding, a hierarchical or cluster-wide KV cache, an MLA
            or linear-attention model, several KV groups, a chunk that cannot be split (``--chunked-prefill-size``
            below 2 x the size), or more ranks than GPUs.
    """
    size = config.parallel.prefill_context_parallel_size
    if size == 1:
        return
    head = f"{FLAG} {size}"
    if config.parallel.tp_size > 1:
        raise ValueError(f"{head} with --tp-size {config.parallel.tp_size}: context parallelism is built with "
                         "--tp-size 1 only (each CP rank holds the whole model)")
    if config.role == "decode":
        raise ValueError(f"{head} splits prefill chunks: a decode worker (--role decode) does not prefill")
    if config.speculative.enabled:
        raise ValueError(f"{head} with --speculative-algorithm {config.speculative.speculative_algorithm}: "
                         "speculative decoding is not built with context parallelism")
    cache = config.cache
    for flag, on in (("--enable-hierarchical-cache", cache.enable_hierarchical_cache),
                     ("--hicache-storage-backend", cache.hicache_storage_backend is not None)):
        if on:
            raise ValueError(f"{head} with {flag}: pages loaded from another tier would reach rank 0's pool only")
    chunk = config.scheduler.chunked_prefill_size
    if chunk is not None and chunk < 2 * size:
        raise ValueError(f"{head} needs --chunked-prefill-size of at least {2 * size} (2 pieces a rank), "
                         f"got {chunk}")
    arch = ArchConfig.from_pretrained(config.model.path)
    if arch.mla is not None or arch.linear_attention_layers:
        kind = "MLA" if arch.mla is not None else "linear-attention"
        raise ValueError(f"{head}: {arch.architecture}'s {kind} layers are not built with context parallelism")
    if not kv_groups(config, arch).is_single:
        raise ValueError(f"{head}: {arch.architecture} has several KV cache groups (sliding-window or chunked "
                         "layers); start with --disable-hybrid-kv-cache-manager to keep one group")
    device = config.device.device
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        base = int(device.split(":")[1]) if ":" in device else 0
        have = torch.cuda.device_count()
        if base + size > have:
            raise ValueError(f"{head} needs {size} GPUs from cuda:{base}, this host has {have}")
