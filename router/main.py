"""``pd-router``: parse flags, build the app, serve it with uvicorn.

SIGTERM/SIGINT start a graceful shutdown: the router stops accepting
connections, answers 503 to new requests on open connections, and lets
in-flight requests (streams included) finish for up to
``--shutdown-grace-period-secs`` before cancelling them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import uvicorn

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
        from pd_cluster.router.discovery.kubernetes import KubernetesDiscovery, load_kube_config

        sources.append(("kubernetes", KubernetesDiscovery(
            config.kubernetes, load_kube_config(config.kubernetes.kubeconfig))))
    if config.ray is not None:
        from pd_cluster.router.discovery.ray import RayDiscovery

        sources.append(("ray", RayDiscovery(config.ray)))
    return sources


class RouterServer(uvicorn.Server):
    """uvicorn server that tells the app to drain as soon as a stop signal arrives, and exits 0 once drained
    (uvicorn re-raises the captured signal after its shutdown: a KeyboardInterrupt traceback for SIGINT)."""

    def __init__(self, config: uvicorn.Config, app: RouterApp) -> None:
        super().__init__(config)
        self.router_app = app

    def handle_exit(self, sig, frame) -> None:
        self.router_app.begin_drain()
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()  # the drain is the answer to the signal


def _loop_and_http() -> tuple[str, str]:
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401
        http = "httptools"
    except ImportError:
        http = "h11"
    return loop, http


def serve(config: RouterConfig) -> None:
    """Run the router until stopped."""
    app = RouterApp(config, build_sources(config))
    loop, http = _loop_and_http()
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, loop=loop, http=http, lifespan="on",
        access_log=False, log_config=None, log_level=config.log_level,
        timeout_graceful_shutdown=max(1, int(config.limits.shutdown_grace_period_secs)),
        timeout_keep_alive=75, backlog=4096, server_header=False, proxy_headers=False)
    log.info("pd-router listening", extra={"host": config.host, "port": config.port,
                                           "loop": loop, "http": http})
    RouterServer(uv_config, app).run()


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format)
    serve(config)


if __name__ == "__main__":
    main()
