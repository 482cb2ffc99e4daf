"""Command line of ``pd-router``.

:func:`build_parser` is importable on its own (the Helm chart's tests parse
rendered command lines with it); :func:`config_from_args` turns the parsed
namespace into a frozen :class:`router.config.RouterConfig`. Flag names
follow SGLang's ``sglang_router.launch_router`` where the concept is the same.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from pd_cluster.router.config import (
    POLICY_NAMES,
    CacheAwareConfig,
    CircuitBreakerConfig,
    HealthConfig,
    KubernetesDiscoveryConfig,
    LimitsConfig,
    PolicyConfig,
    RayDiscoveryConfig,
    RetryConfig,
    RouterConfig,
    SecurityConfig,
)

API_KEY_ENV = "PD_ROUTER_API_KEY"
ADMIN_API_KEY_ENV = "PD_ROUTER_ADMIN_API_KEY"


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


def _add_policies(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policies")
    g.add_argument("--policy", choices=POLICY_NAMES, default=None,
                   help="policy for every role unless overridden (mixed workers: cache_aware)")
    g.add_argument("--prefill-policy", choices=POLICY_NAMES, default=None,
                   help="prefill policy (default cache_aware)")
    g.add_argument("--decode-policy", choices=POLICY_NAMES, default=None,
                   help="decode policy (default least_kv_usage: lowest KV usage with admission room)")
    d = CacheAwareConfig()
    g.add_argument("--cache-threshold", type=float, default=d.cache_threshold)
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold)
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold)
    g.add_argument("--eviction-interval-secs", type=float, default=d.eviction_interval_secs)
    g.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                   help="characters held by the cache-aware tree over all workers")
    g.add_argument("--cache-block-chars", type=int, default=d.block_chars,
                   help="granularity of the approximate prefix tree, in characters")
    g.add_argument("--policy-seed", type=int, default=None, help="seed of random choices")


def _add_resilience(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("resilience")
    r, c, h = RetryConfig(), CircuitBreakerConfig(), HealthConfig()
    g.add_argument("--retry-max-retries", type=int, default=r.max_attempts,
                   help="attempts per request in total, the first included (SGLang semantics)")
    g.add_argument("--retry-initial-backoff-ms", type=float, default=r.initial_backoff_ms)
    g.add_argument("--retry-max-backoff-ms", type=float, default=r.max_backoff_ms)
    g.add_argument("--retry-backoff-multiplier", type=float, default=r.backoff_multiplier)
    g.add_argument("--retry-jitter-factor", type=float, default=r.jitter_factor)
    g.add_argument("--disable-retries", action="store_true")
    g.add_argument("--migration-limit", type=int, default=r.migration_limit,
                   help="times a stream may move to another pair after its decode worker died or "
                        "went silent (0: never)")
    g.add_argument("--cb-failure-threshold", type=int, default=c.failure_threshold)
    g.add_argument("--cb-success-threshold", type=int, default=c.success_threshold)
    g.add_argument("--cb-timeout-duration-secs", type=float, default=c.timeout_duration_secs)
    g.add_argument("--cb-window-duration-secs", type=float, default=c.window_duration_secs)
    g.add_argument("--disable-circuit-breaker", action="store_true")
    g.add_argument("--health-failure-threshold", type=int, default=h.failure_threshold)
    g.add_argument("--health-success-threshold", type=int, default=h.success_threshold)
    g.add_argument("--health-check-timeout-secs", type=float, default=h.timeout_secs)
    g.add_argument("--health-check-interval-secs", type=float, default=h.interval_secs)
    g.add_argument("--health-check-endpoint", default=h.endpoint)
    g.add_argument("--load-refresh-interval-ms", type=float, default=h.load_interval_secs * 1e3,
                   help="period of GET /get_load per worker, for load-based policies")


def _add_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits")
    lim = LimitsConfig()
    g.add_argument("--max-concurrent-requests", type=int, default=lim.max_concurrent_requests,
                   help="requests in flight at once; -1: unlimited")
    g.add_argument("--queue-size", type=int, default=lim.queue_size,
                   help="requests waiting for a slot; past it 429 with Retry-After")
    g.add_argument("--queue-timeout-secs", type=float, default=lim.queue_timeout_secs)
    g.add_argument("--max-payload-size", type=int, default=lim.max_payload_size,
                   help="largest request body in bytes; past it 413")
    g.add_argument("--request-timeout-secs", type=float, default=lim.request_timeout_secs)
    g.add_argument("--connect-timeout-secs", type=float, default=lim.connect_timeout_secs)
    g.add_argument("--upstream-first-byte-timeout-secs", type=float,
                   default=lim.upstream_first_byte_timeout_secs,
                   help="longest wait for a worker's first byte (queueing + prefill)")
    g.add_argument("--upstream-idle-timeout-secs", type=float,
                   default=lim.upstream_idle_timeout_secs,
                   help="longest silence between two chunks of a worker's stream")
    g.add_argument("--upstream-keepalive-secs", type=float, default=lim.upstream_keepalive_secs,
                   help="idle pooled connections to workers are closed after this; keep it "
                        "below the workers' keep-alive timeout (uvicorn: 5 s)")
    g.add_argument("--shutdown-grace-period-secs", type=float,
                   default=lim.shutdown_grace_period_secs,
                   help="on SIGTERM, in-flight requests get this long to finish")


def _add_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help=f"Bearer key required on /v1/* (or env {API_KEY_ENV})")
    g.add_argument("--admin-api-key", default=None,
                   help=f"Bearer key for /workers (or env {ADMIN_API_KEY_ENV})")


def _add_discovery(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("discovery")
    k = KubernetesDiscoveryConfig()
    g.add_argument("--service-discovery", action="store_true",
                   help="find worker pods through the Kubernetes API")
    g.add_argument("--service-discovery-namespace", default=k.namespace)
    g.add_argument("--prefill-selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--decode-selector", nargs="+", default=[], metavar="KEY=VALUE")
    g.add_argument("--selector", nargs="+", default=[], metavar="KEY=VALUE",
                   help="label selector of mixed worker pods")
    g.add_argument("--service-discovery-port", type=int, default=k.port,
                   help="worker port when the pod has no port annotation")
    g.add_argument("--service-discovery-port-annotation", default=k.port_annotation)
    g.add_argument("--service-discovery-resync-secs", type=float, default=k.resync_secs)
    g.add_argument("--service-discovery-watch-timeout-secs", type=int,
                   default=k.watch_timeout_secs)
    g.add_argument("--kubeconfig", default=None,
                   help="default: in-cluster config, else ~/.kube/config")
    r = RayDiscoveryConfig()
    g.add_argument("--ray-discovery", action="store_true",
                   help="find workers that run as named Ray actors")
    g.add_argument("--ray-address", default=r.address)
    g.add_argument("--ray-namespace", default=r.namespace)
    g.add_argument("--ray-actor-prefix", default=r.actor_prefix)
    g.add_argument("--ray-poll-secs", type=float, default=r.poll_secs)


def build_parser() -> argparse.ArgumentParser:
    """The ``pd-router`` argument parser (no side effects)."""
    p = argparse.ArgumentParser(
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
    cache = CacheAwareConfig(
        cache_threshold=a.cache_threshold, balance_abs_threshold=a.balance_abs_threshold,
        balance_rel_threshold=a.balance_rel_threshold,
        eviction_interval_secs=a.eviction_interval_secs, max_tree_size=a.max_tree_size,
        block_chars=a.cache_block_chars)
    d = PolicyConfig()
    return PolicyConfig(
        prefill=a.prefill_policy or a.policy or d.prefill,
        decode=a.decode_policy or a.policy or d.decode,
        mixed=a.policy or d.mixed, cache_aware=cache, seed=a.policy_seed)


def _resilience(a: argparse.Namespace) -> tuple[RetryConfig, CircuitBreakerConfig, HealthConfig]:
    retry = RetryConfig(
        max_attempts=1 if a.disable_retries else a.retry_max_retries,
        initial_backoff_ms=a.retry_initial_backoff_ms, max_backoff_ms=a.retry_max_backoff_ms,
        backoff_multiplier=a.retry_backoff_multiplier, jitter_factor=a.retry_jitter_factor,
        migration_limit=a.migration_limit)
    circuit = CircuitBreakerConfig(
        failure_threshold=a.cb_failure_threshold, success_threshold=a.cb_success_threshold,
        timeout_duration_secs=a.cb_timeout_duration_secs,
        window_duration_secs=a.cb_window_duration_secs, enabled=not a.disable_circuit_breaker)
    health = HealthConfig(
        interval_secs=a.health_check_interval_secs, timeout_secs=a.health_check_timeout_secs,
        failure_threshold=a.health_failure_threshold,
        success_threshold=a.health_success_threshold, endpoint=a.health_check_endpoint,
        load_interval_secs=a.load_refresh_interval_ms / 1e3)
    return retry, circuit, health


def _discovery(a: argparse.Namespace):
    k8s = None
    if a.service_discovery:
        k8s = KubernetesDiscoveryConfig(
            namespace=a.service_discovery_namespace,
            prefill_selector=_selector(a.prefill_selector),
            decode_selector=_selector(a.decode_selector),
            worker_selector=_selector(a.selector), port=a.service_discovery_port,
            port_annotation=a.service_discovery_port_annotation,
            watch_timeout_secs=a.service_discovery_watch_timeout_secs,
            resync_secs=a.service_discovery_resync_secs, kubeconfig=a.kubeconfig)
        if not (k8s.prefill_selector or k8s.decode_selector or k8s.worker_selector):
            raise ValueError("--service-discovery needs --prefill-selector/--decode-selector "
                             "or --selector")
    ray = None
    if a.ray_discovery:
        ray = RayDiscoveryConfig(address=a.ray_address, namespace=a.ray_namespace,
                                 actor_prefix=a.ray_actor_prefix, poll_secs=a.ray_poll_secs)
    return k8s, ray


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    """Build the frozen config; raises ``ValueError`` on inconsistent flags."""
    retry, circuit, health = _resilience(a)
    k8s, ray = _discovery(a)
    limits = LimitsConfig(
        max_concurrent_requests=a.max_concurrent_requests, queue_size=a.queue_size,
        queue_timeout_secs=a.queue_timeout_secs, max_payload_size=a.max_payload_size,
        request_timeout_secs=a.request_timeout_secs, connect_timeout_secs=a.connect_timeout_secs,
        upstream_first_byte_timeout_secs=a.upstream_first_byte_timeout_secs,
        upstream_idle_timeout_secs=a.upstream_idle_timeout_secs,
        upstream_keepalive_secs=a.upstream_keepalive_secs,
        shutdown_grace_period_secs=a.shutdown_grace_period_secs)
    security = SecurityConfig(
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        admin_api_key=a.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None)
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
