"""Command line of ``pd-router``.

:func:`build_parser` is importable on its own (the Helm chart's tests parse
rendered command lines with it); :func:`config_from_args` turns the parsed
namespace into a frozen :class:`router.config.RouterConfig`. Flag names
follow SGLang's ``sglang_router.launch_router`` where the concept is the same.
Flags that set one config field each are rows of `pd_cluster.common.flags.Flag`
tables (as the engine's and the transfer's), with defaults read from the config
dataclasses; the few that combine or convert values are written out.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from pd_cluster.common.flags import Flag, add_flags, flag_values
from pd_cluster.router.config import (
    POLICY_NAMES,
    CacheAwareConfig,
    CircuitBreakerConfig,
    HealthConfig,
    KubernetesDiscoveryConfig,
    KvRoutingConfig,
    LimitsConfig,
    PolicyConfig,
    RayDiscoveryConfig,
    RetryConfig,
    RouterConfig,
    SecurityConfig,
)

API_KEY_ENV = "PD_ROUTER_API_KEY"
ADMIN_API_KEY_ENV = "PD_ROUTER_ADMIN_API_KEY"
INTERNAL_API_KEY_ENV = "PD_INTERNAL_API_KEY"


def _add_workers(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers")
    g.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                   help="prefill worker URL(s); repeatable")
    g.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode worker URL(s); repeatable")
    g.add_argument("--worker", "--worker-urls", dest="worker", nargs="+", action="extend",
                   default=[], metavar="URL", help="mixed worker URL(s), routed without a prefill")
    g.add_argument("--served-model-name", nargs="+", default=[],
                   help="model name(s) accepted in requests; default: learned from the workers")


# Flags that set one field of a config section each: (section of RouterConfig, rows). The defaults are read
# from the config dataclasses (`add_flags`), so each is written once.
POLICY_FLAGS: tuple[Flag, ...] = (
    Flag("--cache-threshold", "policy.cache_aware.cache_threshold", float, None),
    Flag("--balance-abs-threshold", "policy.cache_aware.balance_abs_threshold", int, None),
    Flag("--balance-rel-threshold", "policy.cache_aware.balance_rel_threshold", float, None),
    Flag("--eviction-interval-secs", "policy.cache_aware.eviction_interval_secs", float, None),
    Flag("--max-tree-size", "policy.cache_aware.max_tree_size", int,
         "characters held by the cache-aware tree over all workers"),
    Flag("--cache-block-chars", "policy.cache_aware.block_chars", int,
         "granularity of the approximate prefix tree, in characters"),
    Flag("--policy-seed", "policy.seed", int, "seed of random choices"),
)
KV_FLAGS: tuple[Flag, ...] = (
    Flag("--tokenizer-path", "policy.kv.tokenizer_path", str,
         "the model's tokenizer folder: the router then tokenizes prompts itself to route on the workers' KV events "
         "(without it, it learns the workers' text-to-page maps)", aliases=("--tokenizer",)),
    Flag("--kv-overlap-score-weight", "policy.kv.overlap_score_weight", float,
         "cost = weight x uncached fraction of the prompt + load in requests"),
    Flag("--kv-events-stale-secs", "policy.kv.stale_secs", float,
         "an index not refreshed for this long is not used (the approximate tree is)"),
    Flag("--kv-index-max-pages", "policy.kv.max_pages", int, "pages indexed per worker at most"),
    Flag("--kv-text-map-max-entries", "policy.kv.text_map_max_entries", int,
         "entries of the workers' text-to-page maps kept (about 250 bytes each)"),
    Flag("--tokenizer-threads", "policy.kv.tokenizer_threads", int,
         "threads tokenizing prompts (each encodes every prompt waiting in one batch)"),
    Flag("--tokenizer-cache-max-tokens", "policy.kv.tokenizer_cache_tokens", int,
         "token ids of recent prompts kept to answer repeats and later turns of a chat (0: no cache)"),
)
RETRY_FLAGS: tuple[Flag, ...] = (
    Flag("--retry-max-retries", "retry.max_attempts", int,
         "attempts per request in total, the first included (SGLang semantics)"),
    Flag("--retry-initial-backoff-ms", "retry.initial_backoff_ms", float, None),
    Flag("--retry-max-backoff-ms", "retry.max_backoff_ms", float, None),
    Flag("--retry-backoff-multiplier", "retry.backoff_multiplier", float, None),
    Flag("--retry-jitter-factor", "retry.jitter_factor", float, None),
    Flag("--migration-limit", "retry.migration_limit", int,
         "times a stream may move to another pair after its decode worker died or went silent (0: never)"),
)
CIRCUIT_FLAGS: tuple[Flag, ...] = (
    Flag("--cb-failure-threshold", "circuit.failure_threshold", int, None),
    Flag("--cb-success-threshold", "circuit.success_threshold", int, None),
    Flag("--cb-timeout-duration-secs", "circuit.timeout_duration_secs", float, None),
    Flag("--cb-window-duration-secs", "circuit.window_duration_secs", float, None),
)
HEALTH_FLAGS: tuple[Flag, ...] = (
    Flag("--health-failure-threshold", "health.failure_threshold", int, None),
    Flag("--health-success-threshold", "health.success_threshold", int, None),
    Flag("--health-check-timeout-secs", "health.timeout_secs", float, None),
    Flag("--health-check-interval-secs", "health.interval_secs", float, None),
    Flag("--health-check-endpoint", "health.endpoint", str, None),
)
LIMIT_FLAGS: tuple[Flag, ...] = (
    Flag("--max-concurrent-requests", "limits.max_concurrent_requests", int,
         "sequences in flight at once (a request counts one per prompt and choice); -1: unlimited"),
    Flag("--max-prompts-per-request", "limits.max_prompts_per_request", int,
         "prompts in one completions request; past it 400"),
    Flag("--queue-size", "limits.queue_size", int, "requests waiting for a slot; past it 429 with Retry-After"),
    Flag("--queue-timeout-secs", "limits.queue_timeout_secs", float, None),
    Flag("--max-payload-size", "limits.max_payload_size", int, "largest request body in bytes; past it 413"),
    Flag("--request-timeout-secs", "limits.request_timeout_secs", float, None),
    Flag("--connect-timeout-secs", "limits.connect_timeout_secs", float, None),
    Flag("--upstream-first-byte-timeout-secs", "limits.upstream_first_byte_timeout_secs", float,
         "longest wait for a worker's first byte of a stream (queueing + prefill)"),
    Flag("--upstream-idle-timeout-secs", "limits.upstream_idle_timeout_secs", float,
         "longest silence between two chunks of a worker's stream"),
    Flag("--upstream-keepalive-secs", "limits.upstream_keepalive_secs", float,
         "idle pooled connections to workers are closed after this; keep it "
         "below the workers' keep-alive timeout (uvicorn: 5 s)"),
    Flag("--shutdown-grace-period-secs", "limits.shutdown_grace_period_secs", float,
         "on SIGTERM, in-flight requests get this long to finish"),
)
KUBERNETES_FLAGS: tuple[Flag, ...] = (
    Flag("--service-discovery-namespace", "namespace", str, None),
    Flag("--service-discovery-port", "port", int, "worker port when the pod has no port annotation"),
    Flag("--service-discovery-port-annotation", "port_annotation", str, None),
    Flag("--service-discovery-resync-secs", "resync_secs", float, None),
    Flag("--service-discovery-watch-timeout-secs", "watch_timeout_secs", int, None),
    Flag("--kubeconfig", "kubeconfig", str, "default: in-cluster config, else ~/.kube/config"),
)
RAY_FLAGS: tuple[Flag, ...] = (
    Flag("--ray-address", "address", str, None),
    Flag("--ray-namespace", "namespace", str, None),
    Flag("--ray-actor-prefix", "actor_prefix", str, None),
    Flag("--ray-poll-secs", "poll_secs", float, None),
)


def _add_policies(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policies")
    g.add_argument("--policy", choices=POLICY_NAMES, default=None,
                   help="policy for every role unless overridden (mixed workers: cache_aware)")
    g.add_argument("--prefill-policy", choices=POLICY_NAMES, default=None,
                   help="prefill policy (default cache_aware)")
    g.add_argument("--decode-policy", choices=POLICY_NAMES, default=None,
                   help="decode policy (default least_kv_usage: lowest KV usage with admission room)")
    add_flags(g, POLICY_FLAGS, RouterConfig())
    add_flags(g, KV_FLAGS, RouterConfig())
    g.add_argument("--no-kv-events", action="store_true",
                   help="cache_aware ignores the workers' KV events: the approximate tree only (Dynamo's flag)")
    g.add_argument("--kv-events-interval-ms", type=float, default=KvRoutingConfig().poll_interval_secs * 1e3,
                   help="period of GET /kv_events per worker")


def _add_resilience(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("resilience")
    add_flags(g, RETRY_FLAGS, RouterConfig())
    g.add_argument("--disable-retries", action="store_true")
    add_flags(g, CIRCUIT_FLAGS, RouterConfig())
    g.add_argument("--disable-circuit-breaker", action="store_true")
    add_flags(g, HEALTH_FLAGS, RouterConfig())
    g.add_argument("--load-refresh-interval-ms", type=float, default=HealthConfig().load_interval_secs * 1e3,
                   help="period of GET /get_load per worker, for load-based policies")


def _add_limits(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("limits"), LIMIT_FLAGS, RouterConfig())


def _add_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help=f"Bearer key required on /v1/* (or env {API_KEY_ENV}); as vLLM's, other paths stay open")
    g.add_argument("--api-key-protects-all-paths", action="store_true",
                   help="require --api-key on every path but /health and /readiness (/tokenize, /metrics, ...; "
                        "/workers keeps its admin key)")
    g.add_argument("--admin-api-key", default=None,
                   help=f"Bearer key for /workers (or env {ADMIN_API_KEY_ENV})")
    g.add_argument("--internal-api-key", default=None,
                   help="the cluster's internal key, sent to the workers as X-PD-Internal-Key "
                        f"(prefer env {INTERNAL_API_KEY_ENV})")


def _add_discovery(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("discovery")
    g.add_argument("--service-discovery", action="store_true",
                   help="find worker pods through the Kubernetes API")
    g.add_argument("--prefill-selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--decode-selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--selector", nargs="+", default=[], metavar="KEY=VALUE",
                   help="label selector of mixed worker pods")
    add_flags(g, KUBERNETES_FLAGS, KubernetesDiscoveryConfig())
    g.add_argument("--ray-discovery", action="store_true",
                   help="find workers that run as named Ray actors")
    add_flags(g, RAY_FLAGS, RayDiscoveryConfig())


def build_parser() -> argparse.ArgumentParser:
    """The ``pd-router`` argument parser (no side effects)."""
    p = argparse.ArgumentParser(allow_abbrev=False, 
        prog="pd-router",
        description="OpenAI-compatible router for prefill/decode disaggregated workers.")
    p.add_argument("--host", default=RouterConfig.host)
    p.add_argument("--port", type=int, default=RouterConfig.port)
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--log-format", default="json", choices=["json", "text"])
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per finished request")
    _add_workers(p)
    _add_policies(p)
    _add_resilience(p)
    _add_limits(p)
    _add_security(p)
    _add_discovery(p)
    return p


def _selector(pairs: Sequence[str]) -> str | None:
    """``["app=pd", "role=prefill"]`` -> ``"app=pd,role=prefill"``; ``None`` when empty."""
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"selector {pair!r} is not KEY=VALUE")
    return ",".join(pairs) if pairs else None


def _policies(a: argparse.Namespace) -> PolicyConfig:
    cache = CacheAwareConfig(**flag_values(a, POLICY_FLAGS, skip_none=False, section="policy.cache_aware"))
    kv = KvRoutingConfig(**flag_values(a, KV_FLAGS, skip_none=False, section="policy.kv"),
                         poll_interval_secs=a.kv_events_interval_ms / 1e3, kv_events=not a.no_kv_events)
    d = PolicyConfig()
    return PolicyConfig(
        prefill=a.prefill_policy or a.policy or d.prefill,
        decode=a.decode_policy or a.policy or d.decode,
        mixed=a.policy or d.mixed, cache_aware=cache, kv=kv, seed=a.policy_seed)


def _resilience(a: argparse.Namespace) -> tuple[RetryConfig, CircuitBreakerConfig, HealthConfig]:
    retry = RetryConfig(**dict(flag_values(a, RETRY_FLAGS, skip_none=False, section="retry"),
                               **({"max_attempts": 1} if a.disable_retries else {})))
    circuit = CircuitBreakerConfig(**flag_values(a, CIRCUIT_FLAGS, skip_none=False, section="circuit"),
                                   enabled=not a.disable_circuit_breaker)
    health = HealthConfig(**flag_values(a, HEALTH_FLAGS, skip_none=False, section="health"),
                          load_interval_secs=a.load_refresh_interval_ms / 1e3)
    return retry, circuit, health


def _discovery(a: argparse.Namespace):
    k8s = None
    if a.service_discovery:
        k8s = KubernetesDiscoveryConfig(
            **flag_values(a, KUBERNETES_FLAGS, skip_none=False),
            prefill_selector=_selector(a.prefill_selector),
            decode_selector=_selector(a.decode_selector),
            worker_selector=_selector(a.selector))
        if not (k8s.prefill_selector or k8s.decode_selector or k8s.worker_selector):
            raise ValueError("--service-discovery needs --prefill-selector/--decode-selector "
                             "or --selector")
    ray = None
    if a.ray_discovery:
        ray = RayDiscoveryConfig(**flag_values(a, RAY_FLAGS, skip_none=False))
    return k8s, ray


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    """Build the frozen config; raises ``ValueError`` on inconsistent flags."""
    retry, circuit, health = _resilience(a)
    k8s, ray = _discovery(a)
    limits = LimitsConfig(**flag_values(a, LIMIT_FLAGS, skip_none=False, section="limits"))
    security = SecurityConfig(
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        admin_api_key=a.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None,
        internal_api_key=a.internal_api_key or os.environ.get(INTERNAL_API_KEY_ENV) or None,
        api_key_protects_all_paths=a.api_key_protects_all_paths)
    return RouterConfig(
        host=a.host, port=a.port, prefill_urls=tuple(a.prefill), decode_urls=tuple(a.decode),
        worker_urls=tuple(a.worker), served_model_names=tuple(a.served_model_name),
        policy=_policies(a), retry=retry, circuit=circuit, health=health, limits=limits,
        security=security, kubernetes=k8s, ray=ray, log_level=a.log_level,
        log_format=a.log_format, enable_log_requests=a.enable_log_requests)


def parse_config(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse ``argv`` into a :class:`RouterConfig` (exits with usage on bad flags)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
