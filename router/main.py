"""``pd-router``: parse flags, build the app, serve it on the router's own HTTP server (uvloop).

SIGTERM/SIGINT start a graceful shutdown: the router stops accepting
connections, answers 503 to new requests on open connections, and lets
in-flight requests (streams included) finish for up to
``--shutdown-grace-period-secs`` before cancelling them; then it exits 0.
A second signal ends it at once (exit 1).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Sequence

from pd_cluster.common.process import exit_now
from pd_cluster.router.app import RouterApp
from pd_cluster.router.args import parse_config
from pd_cluster.router.config import RouterConfig
from pd_cluster.router.discovery.base import DiscoverySource
from pd_cluster.router.logs import setup_logging

log = logging.getLogger("pd_cluster.router.main")


def build_sources(config: RouterConfig) -> list[tuple[str, DiscoverySource]]:
    """Discovery sources named by the config (imports their clients lazily)."""
    sources: list[tuple[str, DiscoverySource]] = []
    if config.kubernetes is not None:
        try:
            from pd_cluster.router.discovery.kubernetes import KubernetesDiscovery, load_kube_config
        except ImportError as e:  # an optional dependency since the client is 120 MB
            raise SystemExit(f"pd-router: Kubernetes discovery needs the kubernetes client ({e}): "
                             "pip install 'pd-cluster[k8s]'") from None

        sources.append(("kubernetes", KubernetesDiscovery(
            config.kubernetes, load_kube_config(config.kubernetes.kubeconfig))))
    if config.ray is not None:
        from pd_cluster.router.discovery.ray import RayDiscovery

        sources.append(("ray", RayDiscovery(config.ray)))
    return sources


async def run(config: RouterConfig, app: RouterApp) -> int:
    """Serve until a stop signal, then drain; returns the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = []

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        if len(signals) == 1:
            app.begin_drain()
            stop.set()
        else:
            log.warning("second stop signal: exiting without draining")
            os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await app.startup()
    server = app.server()
    try:
        await server.listen(config.host, config.port, backlog=4096)
    except OSError as exc:
        log.error("cannot listen", extra={"host": config.host, "port": config.port, "reason": str(exc)})
        await app.shutdown()
        return 1
    # What start-up built (the web framework, the config, the app) lives as long as the process: out of the
    # garbage collector's generations, full collections no longer walk it on the request path.
    gc.freeze()
    log.info("pd-router listening", extra={"host": config.host, "port": config.port,
                                           "loop": type(loop).__module__.split(".")[0]})
    await stop.wait()
    server.stop_accepting()
    cancelled = await server.drain(config.limits.shutdown_grace_period_secs)
    if cancelled:
        log.warning("grace period over: in-flight requests cancelled", extra={"requests": cancelled})
    await app.shutdown()
    return 0


def serve(config: RouterConfig) -> int:
    """Run the router until stopped; returns the exit code."""
    app = RouterApp(config, build_sources(config))
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency on Linux and macOS; plain asyncio elsewhere
        return asyncio.run(run(config, app))
    return uvloop.run(run(config, app))


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format)
    exit_now(serve(config))  # drained and shut down: skip the interpreter's slow teardown


if __name__ == "__main__":
    main()
