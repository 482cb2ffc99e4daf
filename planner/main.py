"""``pd-planner``: the planner as its own process, beside a router it reaches over HTTP.

It runs the same loop as ``pd-serve --autoscale`` (`pd_cluster.planner.runner.PlannerRunner`) against
``--router-url``, and serves its ``pd:planner_*`` metrics on ``--port`` (``/metrics``). ``--connector`` says what
acts on a decision: ``kubernetes`` scales the prefill and decode StatefulSets (`pd_cluster.planner.kube`; it
refuses to start without the RBAC to do so), ``none`` logs and exports decisions and changes nothing (Dynamo's
planner calls this ``--no-operation``). It sends ``--admin-api-key`` to the router's ``/workers`` and ``--api-key`` to its
``/metrics`` (which wants it under the router's ``--api-key-protects-all-paths``); a router that refuses either key
stops it at start-up, naming the flag. The planner holds no state of the cluster's: killed and started again, it reads the counts
serving from the router and resumes from them; meanwhile the cluster serves at its current sizes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from pd_cluster.planner.config import add_planner_args, planner_config_from_args
from pd_cluster.planner.decision import Decision
from pd_cluster.planner.runner import PlannerMetrics, PlannerRunner
from pd_cluster.planner.scrape import ClusterView, MetricsSource

ADMIN_API_KEY_ENV = "PD_ROUTER_ADMIN_API_KEY"
API_KEY_ENV = "PD_ROUTER_API_KEY"
CONNECTORS = ("kubernetes", "none")


class NoOpConnector:
    """Acts on nothing: decisions are only logged and exported."""

    name = "none"

    def targets(self) -> dict[str, int]:
        return {}

    def apply(self, decision: Decision, view: ClusterView) -> None:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-planner", allow_abbrev=False,
                                description="Size a pd-cluster's prefill and decode roles to TTFT and ITL targets.")
    p.add_argument("--router-url", required=True, help="the router's base URL, e.g. http://pd-router:8000")
    p.add_argument("--admin-api-key", default=None, help=f"the router's admin key, for its /workers (or env "
                   f"{ADMIN_API_KEY_ENV})")
    p.add_argument("--api-key", default=None, help=f"the router's API key, for its /metrics when the router runs with "
                   f"--api-key-protects-all-paths (or env {API_KEY_ENV})")
    p.add_argument("--connector", choices=CONNECTORS, default="none",
                   help="what acts on a decision: kubernetes (scale the role StatefulSets), none (log and export)")
    p.add_argument("--namespace", default=None, help="with --connector kubernetes: the workloads' namespace "
                   "(default: the pod's own, else 'default')")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-workload", default=None, metavar="STATEFULSET",
                       help=f"with --connector kubernetes: the {role} workers' StatefulSet")
    p.add_argument("--host", default="0.0.0.0", help="address of the metrics server")
    p.add_argument("--port", type=int, default=9091, help="port of the pd:planner_* metrics (/metrics)")
    p.add_argument("--log-level", default="info")
    add_planner_args(p)
    return p


NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def make_connector(parser: argparse.ArgumentParser, args: argparse.Namespace, admin_key: str | None,
                   metrics: PlannerMetrics, api_client=None):
    """The connector `args` name; a Kubernetes one only when the API server grants it `kube.REQUIRED` (else
    `parser` stops, naming ``--connector``)."""
    if args.connector == "none":
        return NoOpConnector()
    from pd_cluster.planner.actions import RouterAdmin
    from pd_cluster.planner.kube import KubernetesConnector

    missing_flags = [f"--{r}-workload" for r in ("prefill", "decode") if not getattr(args, f"{r}_workload")]
    if missing_flags:
        parser.error(f"--connector kubernetes needs {' and '.join(missing_flags)}")
    namespace = args.namespace
    if namespace is None:
        try:
            with open(NAMESPACE_FILE) as f:
                namespace = f.read().strip()
        except OSError:
            namespace = "default"
    connector = KubernetesConnector(RouterAdmin(args.router_url, admin_key), namespace,
                                    {"prefill": args.prefill_workload, "decode": args.decode_workload},
                                    api_client, metrics)
    try:
        denied = connector.missing_permissions()
    except Exception as e:  # noqa: BLE001 - the API server's answer, whatever it is, stops the start
        parser.error(f"--connector kubernetes: could not ask the API server for the planner's permissions ({e})")
    if denied:
        parser.error(f"--connector kubernetes: the planner's service account may not {', '.join(denied)} in "
                     f"namespace {namespace!r}; grant them (the chart's planner.rbac.create) or use --connector none")
    return connector


def main(argv: list[str] | None = None, api_client=None) -> int:
    """Run ``pd-planner`` (`api_client`: a ``kubernetes.client.ApiClient`` for ``--connector kubernetes``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = planner_config_from_args(parser, args)
    if not 0 <= args.port < 65536:
        parser.error(f"--port: {args.port} is not a TCP port")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    admin_key = args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None
    metrics = PlannerMetrics()
    connector = make_connector(parser, args, admin_key, metrics, api_client)
    from prometheus_client import start_http_server

    source = MetricsSource(args.router_url, admin_key, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    refused = source.refusals()
    for path, flag, env in (("/workers", "--admin-api-key", ADMIN_API_KEY_ENV), ("/metrics", "--api-key", API_KEY_ENV)):
        if path in refused:
            parser.error(f"{flag}: the router at {args.router_url} answers {refused[path]} to the planner's GET "
                         f"{path}; give its key ({flag} or env {env}), or every decision stays frozen")
    server, _ = start_http_server(args.port, args.host, registry=metrics.registry)
    runner = PlannerRunner(config, source, connector, metrics)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    runner.start()
    logging.getLogger("pd_cluster.planner").info("pd-planner: %s connector, every %g s, metrics on %s:%d",
                                                 connector.name, config.interval_secs, args.host, args.port)
    done.wait()
    runner.stop()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
