"""Building the store tier from the engine's configuration (``--hicache-storage-*``), SGLang's way.

The store's settings come from ``--hicache-storage-backend-extra-config`` (a JSON object) first, then from
SGLang's environment variables:

| setting | extra-config key | environment | default |
| --- | --- | --- | --- |
| Mooncake master | ``master_server_address`` | ``MOONCAKE_MASTER`` | none: required |
| transfer-engine metadata | ``metadata_server`` | ``MOONCAKE_TE_META_DATA_SERVER`` | ``P2PHANDSHAKE`` |
| protocol | ``protocol`` | ``MOONCAKE_PROTOCOL`` | ``tcp`` |
| RDMA devices | ``device_name`` | ``MOONCAKE_DEVICE`` | none |
| this host's address | ``local_hostname`` | ``MOONCAKE_LOCAL_HOSTNAME`` | ``127.0.0.1`` |
| memory this worker lends the store | ``global_segment_size`` | ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` | 0 |
| transfer buffer | ``local_buffer_size`` | ``MOONCAKE_LOCAL_BUFFER_SIZE`` | 64 MiB |
| file store directory | ``storage_dir`` | ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` | ``/tmp/hicache`` |
| prefetch wait | ``prefetch_timeout`` | | 1.0 s |

Sizes take units (``4GiB``) or bytes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pd_cluster.engine.config import CacheConfig, parse_size
from pd_cluster.engine.model.loader import _weight_files as weight_files
from pd_cluster.engine.kv.l3.backends import (FileBackend, MooncakeBackend, MooncakeSettings, StorageBackend,
                                              StoreUnavailable)
from pd_cluster.engine.kv.l3.keys import PageNamespace, model_fingerprint
from pd_cluster.engine.kv.l3.tier import L3Tier

logger = logging.getLogger("engine")

FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_FILE_DIR = "/tmp/hicache"
_MOONCAKE_ENV = {"master_server_address": "MOONCAKE_MASTER", "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
                 "protocol": "MOONCAKE_PROTOCOL", "device_name": "MOONCAKE_DEVICE",
                 "local_hostname": "MOONCAKE_LOCAL_HOSTNAME", "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                 "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE"}
_SIZES = ("global_segment_size", "local_buffer_size")


def extra_config(cache: CacheConfig) -> dict:
    return json.loads(cache.hicache_storage_backend_extra_config or "{}")


def make_backend(cache: CacheConfig) -> StorageBackend:
    """The backend `cache` names (not connected yet).

    Raises:
        ValueError: a setting is malformed; StoreUnavailable: Mooncake without a master address.
    """
    extra = extra_config(cache)
    if cache.hicache_storage_backend == "file":
        return FileBackend(extra.get("storage_dir") or os.environ.get(FILE_DIR_ENV) or DEFAULT_FILE_DIR)
    values = {}
    for name, env in _MOONCAKE_ENV.items():
        value = extra.get(name, os.environ.get(env))
        if value is None or value == "":
            continue
        values[name] = parse_size(value) if name in _SIZES and isinstance(value, str) else value
    if "master_server_address" not in values:
        raise StoreUnavailable("--hicache-storage-backend mooncake needs the master's address: "
                               "'master_server_address' in --hicache-storage-backend-extra-config or MOONCAKE_MASTER "
                               "(pd-serve and the Helm chart start a master and pass it)")
    return MooncakeBackend(MooncakeSettings(**values))


def build_l3(cache: CacheConfig, namespace: PageNamespace, pool_kv, page_size: int, on_written=None,
             backend: StorageBackend | None = None) -> L3Tier | None:
    """The store tier, connected; None when `cache` names no store.

    A store that cannot be reached at start-up is a warning (the tier starts unavailable and keeps trying to
    reconnect), or, with ``--hicache-storage-required``, an error.

    Raises:
        RuntimeError: the store is required and cannot be reached.
    """
    if not cache.hicache_storage_backend:
        return None
    extra = extra_config(cache)
    timeout = float(extra.get("prefetch_timeout", 1.0))
    try:
        backend = backend or make_backend(cache)
        backend.reconnect()
        err = None
    except StoreUnavailable as e:
        if cache.hicache_storage_required:
            raise RuntimeError(f"--hicache-storage-required: the KV store ({cache.hicache_storage_backend}) "
                               f"cannot be reached: {e}") from None
        err = e
    tier = L3Tier(backend, namespace, pool_kv, page_size, cache.hicache_storage_prefetch_policy, timeout,
                  on_written) if backend is not None else None
    if tier is None:  # no backend could even be made (Mooncake without a master): no tier to reconnect
        logger.warning("KV store (%s) not used: %s; serving without it", cache.hicache_storage_backend, err)
        return None
    if err is not None:
        logger.warning("KV store (%s) unreachable at start-up: %s; serving without it until it answers "
                       "(--hicache-storage-required makes this an error)", cache.hicache_storage_backend, err)
        tier._lost(err)
    else:
        logger.info("KV store: %s, keys %s*, prefetch policy %s (timeout %.2f s), write-through",
                    backend.name, namespace.prefix, cache.hicache_storage_prefetch_policy, timeout)
    return tier


def engine_namespace(model_name: str, identity: str, dtype: str, weight_files: list[Path], kv_dtype: str,
                     page_size: int, layout_hash: str) -> PageNamespace:
    """The keys' namespace of an engine (`keys` module docstring)."""
    return PageNamespace(model_name, model_fingerprint(identity, dtype, weight_files), kv_dtype, page_size,
                         layout_hash)


class FanOut:
    """Several prefix-cache observers as one (the KV event log, then the store tier)."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def stored(self, parent_page, pages, tokens) -> None:
        for o in self.observers:
            o.stored(parent_page, pages, tokens)

    def removed(self, pages) -> None:
        for o in self.observers:
            o.removed(pages)


def attach_l3(engine) -> L3Tier | None:
    """Build the store tier of `engine` (an `LLMEngine` being built) and wire it: the prefix cache's observer,
    the page manager's reads, the KV events' L3 entries. None when no store is configured.

    Raises:
        ValueError: the store is asked for where it is not built (no prefix cache is checked by the config; a
            model whose layers form several KV cache groups).
        RuntimeError: as `build_l3`.
    """
    cache = engine.config.cache
    if not cache.hicache_storage_backend:
        return None
    if not engine.kv_groups.is_single:
        raise ValueError("--hicache-storage-backend is not built for models whose layers form several KV cache "
                         "groups (sliding-window or chunked layers); add --disable-hybrid-kv-cache-manager")
    mc, loaded, layout = engine.config.model, engine.loaded, engine.layout
    files = [] if mc.load_format == "dummy" else weight_files(Path(mc.path))
    ns = engine_namespace(engine.model_name, loaded.identity, str(loaded.dtype).removeprefix("torch."), files,
                          layout.kv_cache_dtype, layout.page_size, layout.hash())
    tier = build_l3(cache, ns, engine.pool.kv, layout.page_size, engine.kv_events.l3_stored)
    if tier is not None:
        prefix_cache = engine.prefix_cache
        prefix_cache.observer = FanOut(prefix_cache.observer, tier) if prefix_cache.observer else tier
        engine.pages.l3 = tier
    return tier
