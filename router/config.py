"""Typed, frozen configuration of the router.

Every field maps to one command-line flag of ``pd-router`` (see
:func:`pd_cluster.router.args.build_parser`); flag names follow SGLang's router
(``sglang_router.launch_router``) where the concept is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Role(str, Enum):
    """The role of a worker, as in ``docs/worker-api.md``."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


POLICY_NAMES = ("round_robin", "random", "power_of_two", "cache_aware", "least_kv_usage")


@dataclass(frozen=True)
class CacheAwareConfig:
    """Knobs of the ``cache_aware`` policy (SGLang router semantics).

    ``cache_threshold``: the fraction of the prompt (0..1) that must match a
    worker's tree for the request to follow the match.
    ``balance_abs_threshold`` / ``balance_rel_threshold``: the load is
    imbalanced, and the policy falls back to the least loaded worker, when
    ``max_load - min_load > abs`` and ``max_load > rel * min_load``.
    ``eviction_interval_secs``: how often idle entries are evicted; an entry
    not touched for that long is idle.
    ``max_tree_size``: bound on the characters held in the tree over all workers.
    ``block_chars``: the granularity of the approximate tree, in characters.
    """

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 120.0
    max_tree_size: int = 2**24
    block_chars: int = 64

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        if self.block_chars < 1 or self.max_tree_size < self.block_chars:
            raise ValueError("block_chars must be >= 1 and <= max_tree_size")


@dataclass(frozen=True)
class KvRoutingConfig:
    """``cache_aware`` on the workers' real cache state, from their KV events (``docs/router.md``).

    ``tokenizer_path``: the model's tokenizer folder (``--tokenizer-path``): the router then tokenizes prompts
    itself; without it, it learns which text prefixes make which pages from the workers' text-to-page maps
    (``GET /kv_text_map``, `router.text_map`). ``kv_events``: poll ``GET /kv_events`` and use it
    (``--no-kv-events``, Dynamo's flag, turns it off). ``text_map_max_entries``: entries of the text-to-page map
    the router holds at most. ``poll_interval_secs``: the poll period per worker.
    ``stale_secs``: an index whose last good poll is older is not used. ``overlap_score_weight``: the weight
    of the uncached fraction of the prompt against the load in requests (Dynamo's ``--kv-overlap-score-weight``).
    ``max_pages``: per-worker bound of the index. ``max_prompt_chars``: longer prompts are tokenized only up to
    this many characters (the pages near the cut are not hashed). ``tokenizer_threads``: threads encoding
    prompts (``router.tokenizer``). ``tokenizer_cache_tokens``: token ids the router's prompt cache holds at
    most (0: no cache).
    """

    tokenizer_path: str | None = None
    kv_events: bool = True
    poll_interval_secs: float = 0.1
    stale_secs: float = 2.0
    overlap_score_weight: float = 1.0
    max_pages: int = 1 << 21
    max_prompt_chars: int = 1 << 18
    tokenizer_threads: int = 2
    tokenizer_cache_tokens: int = 1 << 20
    text_map_max_entries: int = 1 << 19

    def __post_init__(self) -> None:
        if self.text_map_max_entries < 1:
            raise ValueError("the text map's max entries must be >= 1")
        if self.tokenizer_threads < 1 or self.tokenizer_cache_tokens < 0:
            raise ValueError("tokenizer threads must be >= 1 and its cache size >= 0")
        if self.poll_interval_secs <= 0 or self.stale_secs <= 0:
            raise ValueError("kv events poll interval and staleness must be > 0")
        if self.overlap_score_weight < 0:
            raise ValueError("kv overlap score weight must be >= 0")
        if self.max_pages < 1 or self.max_prompt_chars < 1:
            raise ValueError("kv index max pages and max prompt chars must be >= 1")

    @property
    def enabled(self) -> bool:
        """Real-state routing is on (``--no-kv-events`` turns it off)."""
        return self.kv_events

    @property
    def tokenized(self) -> bool:
        """Real-state routing with the router's own tokenizer (``--tokenizer-path``), not the text maps."""
        return self.kv_events and bool(self.tokenizer_path)


@dataclass(frozen=True)
class PolicyConfig:
    """One policy per role; names from :data:`POLICY_NAMES`."""

    prefill: str = "cache_aware"
    decode: str = "least_kv_usage"
    mixed: str = "cache_aware"
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    kv: KvRoutingConfig = field(default_factory=KvRoutingConfig)
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in (self.prefill, self.decode, self.mixed):
            if name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")


@dataclass(frozen=True)
class RetryConfig:
    """Retries of failures before the first token (SGLang's ``--retry-*``).

    ``max_attempts`` counts the first try (SGLang's ``retry_max_retries``);
    1 disables retries. ``migration_limit``: how many times one stream may move
    to another pair after it started (Dynamo's ``--migration-limit``; 0: never). The n-th retry waits
    ``min(max_backoff, initial * multiplier**(n-1))`` scaled by a uniform
    factor in ``[1 - jitter, 1 + jitter]``.
    """

    max_attempts: int = 3
    initial_backoff_ms: float = 50.0
    max_backoff_ms: float = 2000.0
    backoff_multiplier: float = 1.5
    jitter_factor: float = 0.2
    migration_limit: int = 3

    def __post_init__(self) -> None:
        if self.migration_limit < 0:
            raise ValueError("migration limit must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("retry max attempts must be >= 1")
        if not 0.0 <= self.jitter_factor <= 1.0:
            raise ValueError("retry jitter factor must be in [0, 1]")


@dataclass(frozen=True)
class CircuitBreakerConfig:
    """Per-worker circuit breaker (SGLang's ``--cb-*``).

    Opens after ``failure_threshold`` consecutive failures, each no older than
    ``window_duration_secs`` than the one before; stays open
    ``timeout_duration_secs``; then half-open, closing after
    ``success_threshold`` consecutive successes.
    """

    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_duration_secs: float = 30.0
    window_duration_secs: float = 120.0
    enabled: bool = True


@dataclass(frozen=True)
class HealthConfig:
    """Active health checks and load polling.

    A worker turns unhealthy after ``failure_threshold`` failed checks in a
    row and healthy again after ``success_threshold`` good ones (the first
    check of a new worker needs one). ``load_interval_secs`` is the
    ``/get_load`` refresh period (see ``docs/router.md`` for the choice).
    """

    interval_secs: float = 5.0
    timeout_secs: float = 2.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    load_interval_secs: float = 0.1


@dataclass(frozen=True)
class LimitsConfig:
    """Admission and size limits, and timeouts of router->worker calls.

    ``connect_timeout_secs``: TCP connect to a worker.
    ``upstream_first_byte_timeout_secs``: from sending a request to the first
    byte of the worker's answer (a worker answers with its first token, so this
    bounds queueing plus prefill: keep it above the longest prefill).
    ``upstream_idle_timeout_secs``: between two chunks of a streamed answer,
    and the longest a worker may show no sign of life at all (no byte, no
    probe answer, no progress) while it holds an attempt. Past either, the
    attempt fails and the request is retried or migrated; a worker whose step
    or transfer counters advance is never failed for a silent stream
    (``router.supervisor``).
    ``max_prompts_per_request``: prompts in one completions request; past it,
    400 (each prompt costs one admission slot per ``n``, ``router.limiter``).
    ``max_header_bytes`` / ``max_header_count``: past either (names and values
    summed, in bytes), a request gets 431 before anything else is read; the
    count is vLLM's ``--h11-max-header-count`` default, the size nginx's
    ``large_client_header_buffers`` (4 x 8 KiB) twice over.
    """

    max_concurrent_requests: int = 1024
    max_prompts_per_request: int = 1024
    queue_size: int = 256
    queue_timeout_secs: float = 30.0
    max_payload_size: int = 32 * 1024 * 1024
    request_timeout_secs: float = 1800.0
    connect_timeout_secs: float = 5.0
    upstream_first_byte_timeout_secs: float = 600.0
    upstream_idle_timeout_secs: float = 30.0
    upstream_keepalive_secs: float = 4.0
    shutdown_grace_period_secs: float = 180.0
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 256


@dataclass(frozen=True)
class SecurityConfig:
    """Bearer keys; ``None`` disables the check (admin: see ``docs/router.md``). ``api_key`` guards ``/v1/*``
    (vLLM's ``--api-key``); with ``api_key_protects_all_paths`` every path but ``/health`` and ``/readiness``."""

    api_key: str | None = None
    admin_api_key: str | None = None
    internal_api_key: str | None = field(default=None, repr=False)  # sent to workers (X-PD-Internal-Key)
    api_key_protects_all_paths: bool = False

    def __post_init__(self) -> None:
        if self.api_key_protects_all_paths and not self.api_key:
            raise ValueError("--api-key-protects-all-paths needs --api-key")


@dataclass(frozen=True)
class KubernetesDiscoveryConfig:
    """Pod discovery through the official ``kubernetes`` client."""

    namespace: str = "default"
    prefill_selector: str | None = None
    decode_selector: str | None = None
    worker_selector: str | None = None
    port: int = 8000
    port_annotation: str = "pd-cluster.io/port"
    scheme: str = "http"
    watch_timeout_secs: int = 300
    resync_secs: float = 300.0
    kubeconfig: str | None = None


@dataclass(frozen=True)
class RayDiscoveryConfig:
    """Discovery of workers that run as named Ray actors."""

    address: str = "auto"
    namespace: str = "pd-cluster"
    actor_prefix: str = "pd-worker"
    poll_secs: float = 5.0


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``pd-router`` needs; built by :func:`pd_cluster.router.args.config_from_args`."""

    host: str = "0.0.0.0"
    port: int = 30000
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    circuit: CircuitBreakerConfig = field(default_factory=CircuitBreakerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    kubernetes: KubernetesDiscoveryConfig | None = None
    ray: RayDiscoveryConfig | None = None
    log_level: str = "info"
    log_format: str = "json"
    enable_log_requests: bool = False
