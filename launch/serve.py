"""``pd-serve``: a whole PD cluster on this machine with one command.

Starts the router and N prefill + M decode workers (default 1P1D) as
subprocesses on the embedded stories260K (or ``--model``), waits until all are
healthy and the router's ``/readiness`` is 200, prints the endpoint and an example
request, restarts a process that dies (with backoff, ``--max-restarts``), and stops
everything on Ctrl-C. No child outlives ``pd-serve``, however it dies (Linux
``PR_SET_PDEATHSIG``). ``--colocated`` starts mixed workers instead.
``--api-key`` and ``--admin-api-key`` are the router's keys, as ``vllm serve`` and
SGLang take them. Every cluster gets a fresh internal key (``secrets.token_urlsafe``, or
``PD_INTERNAL_API_KEY`` when set), passed to the router and the workers through their
environment: worker-internal endpoints refuse calls without it. Engine flags
(``--page-size``, ``--kv-cache-dtype``, ...) and ``--kv-transfer-*`` flags
pass through to every worker; ``--router-arg=--prefill-policy=cache_aware``
passes flags to the router; ``--prefill-arg=--tp-size=2 --decode-arg=--tp-size=1`` gives one role's workers
their own engine flags (`pd_cluster.launch.role_args`). Workers listen on free ports unless ``--prefill-ports``,
``--decode-ports`` or ``--mixed-ports`` name them. ``--autoscale`` runs the planner beside the cluster
(`pd_cluster.launch.autoscale`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from pd_cluster.common.process import exit_now
from pd_cluster.engine.args import ENGINE_FLAGS, add_engine_args
from pd_cluster.engine.model.arch import check_model_folder
from pd_cluster.launch.placement import cuda_device_count, parse_gpu_list
from pd_cluster.launch.cluster import LocalCluster
from pd_cluster.launch.cluster_spec import ADMIN_API_KEY_ENV, API_KEY_ENV, INTERNAL_API_KEY_ENV, ClusterSpec
from pd_cluster.launch.autoscale import AutoscaledCluster, add_autoscale_args, autoscale_config
from pd_cluster.launch.kv_store import plan_kv_store
from pd_cluster.launch.restarts import RestartBackoff
from pd_cluster.launch.role_args import refuse_node_flags, role_argv_of, role_tp_sizes
from pd_cluster.launch.supervise import serve_until_stopped
from pd_cluster.serving.tools.chat import add_tool_args, tool_argv, tool_settings_from_args
from pd_cluster.transfer.config import TRANSFER_FLAGS, add_cli_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
                                prog="pd-serve", description="Run a local pd-cluster (router + workers).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="start mixed workers (no PD)")
    p.add_argument("--num-workers", type=int, default=0,
                   help="mixed workers with --colocated (default: num-prefill + num-decode)")
    p.add_argument("--router-arg", action="append", default=[], help="a flag for the router, e.g. "
                   "--router-arg=--prefill-policy=cache_aware (repeatable)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-arg", action="append", default=[], metavar="FLAG",
                       help=f"an engine or --kv-transfer-* flag for the {role} workers only, overriding the same flag "
                            f"given to every worker, e.g. --{role}-arg=--tp-size=2 (repeatable)")
    p.add_argument("--shutdown-grace-period-secs", type=float, default=None,
                   help="on Ctrl-C/SIGTERM the router stops taking requests and lets those in flight finish for "
                        "up to this many seconds before the workers are stopped (the router's flag; default "
                        f"{ClusterSpec.shutdown_grace_period_secs:g})")
    p.add_argument("--max-prompts-per-request", type=int, default=None,
                   help="the most prompts one completions request may hold (the router's flag; past it 400; "
                        "default 1024)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="the router's log lines: text, as the workers write theirs (default), or one JSON object "
                        "per line (the Helm chart's default, for log collectors)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--fork-workers", action=argparse.BooleanOptionalAction, default=True,
                   help="fork the workers, and their restarts, from a process that imported their code once (the "
                        "default; on a 2-core CPU machine a worker used 1.1-1.8 s of CPU until ready instead of "
                        "5.0-5.2, docs/perf/worker-start.md); --no-fork-workers: a new interpreter each")
    p.add_argument("--manifest", help="write the processes' URLs and PIDs to this JSON file once ready")
    p.add_argument("--ray-address", default=None,
                   help="run the roles as Ray actors on this cluster ('local' starts one here)")
    p.add_argument("--api-key", default=None,
                   help=f"Bearer key clients must send on /v1/* (or env {API_KEY_ENV}); as vllm serve's")
    p.add_argument("--admin-api-key", default=None,
                   help=f"Bearer key of the router's /workers admin API (or env {ADMIN_API_KEY_ENV})")
    for role in ("prefill", "decode", "mixed"):
        p.add_argument(f"--{role}-gpus", default=None, metavar="LIST",
                       help=f"GPUs of the {role} workers, e.g. 0-3 or 0,2 (each worker takes the next --tp-size; "
                            "default: consecutive blocks of all GPUs, prefill first)")
    p.add_argument("--kv-store-size", default=ClusterSpec.kv_store_size,
                   help="with --hicache-storage-backend mooncake and no master given: the memory of the Mooncake "
                        "store pd-serve starts (a master and one process lending this much, on loopback; default "
                        f"{ClusterSpec.kv_store_size})")
    for role in ("prefill", "decode", "mixed"):
        p.add_argument(f"--{role}-ports", default=None, metavar="LIST",
                       help=f"HTTP ports of the {role} workers, one per worker in order, e.g. 30001,30002 or "
                            "30001-30002 (default: free ports below the kernel's ephemeral range)")
    d = RestartBackoff()
    p.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="restarts in a row of a process that keeps dying before pd-serve gives it up; "
                        "-1: never; 0: no restarts")
    p.add_argument("--restart-backoff-max-secs", type=float, default=d.max_delay,
                   help=f"longest wait before a restart (the first waits {d.initial_delay:g} s, then doubling)")
    add_engine_args(p)
    add_cli_args(p)
    add_tool_args(p)
    add_autoscale_args(p)
    return p


def passthrough_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Engine and transfer flags given on our command line, as argv for the workers."""
    out: list[str] = []
    for flag in ENGINE_FLAGS + TRANSFER_FLAGS:
        name, dest = flag.name, flag.dest
        value = getattr(args, dest, None)
        default = parser.get_default(dest)
        if value is None or value == default:
            continue
        if value is True:
            out.append(name)
        elif value is False:
            out.append("--no-" + name[2:])
        else:
            out += [name, str(value)]
    return out


def router_argv_of(args: argparse.Namespace) -> list[str]:
    """The router's flags: ``--log-format``, ``--shutdown-grace-period-secs`` and ``--max-prompts-per-request``
    from ours, then the user's ``--router-arg`` flags (later ones win, as in argparse)."""
    out = ["--log-format", args.log_format]
    if args.shutdown_grace_period_secs is not None:
        out += ["--shutdown-grace-period-secs", str(args.shutdown_grace_period_secs)]
    if args.max_prompts_per_request is not None:
        out += ["--max-prompts-per-request", str(args.max_prompts_per_request)]
    return out + list(args.router_arg)


def router_grace_period(router_argv: list[str]) -> float:
    """The router's ``--shutdown-grace-period-secs`` in `router_argv` (the last one wins, as in argparse), else
    `ClusterSpec`'s default.

    Raises:
        ValueError: the value is not a number.
    """
    grace = ClusterSpec.shutdown_grace_period_secs
    for i, arg in enumerate(router_argv):
        name, eq, value = arg.partition("=")
        if name == "--shutdown-grace-period-secs":
            text = value if eq else (router_argv[i + 1] if i + 1 < len(router_argv) else "")
            try:
                grace = float(text)
            except ValueError:
                raise ValueError(f"--shutdown-grace-period-secs: not a number: {text!r}") from None
    return grace


def parse_port_list(text: str, flag: str) -> tuple[int, ...]:
    """``30001,30002`` or ``30001-30004`` (or both, comma-separated) as ports, in order.

    Raises:
        ValueError: not such a list.
    """
    out: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"{flag}: {text!r} is not a list of ports such as 30001,30002 or 30001-30004") from None
        if last < first:
            raise ValueError(f"{flag}: {part!r} is an empty range")
        out += range(first, last + 1)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("--api-key", "--admin-api-key", "--internal-api-key"):
        if any(a == flag or a.startswith(flag + "=") for a in args.router_arg):
            parser.error(f"give {flag} to pd-serve itself, not through --router-arg (pd-serve needs the keys too)")
    if args.shutdown_grace_period_secs is not None and args.shutdown_grace_period_secs < 0:
        parser.error("--shutdown-grace-period-secs must be >= 0")
    router_argv = router_argv_of(args)
    try:
        grace = router_grace_period(router_argv)
    except ValueError as e:
        parser.error(str(e))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    admin_api_key = args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None
    internal_api_key = os.environ.get(INTERNAL_API_KEY_ENV) or secrets.token_urlsafe(32)
    planner = autoscale_config(parser, args)
    if planner is not None and api_key and not admin_api_key:
        parser.error("--autoscale with --api-key needs --admin-api-key: the planner reads the router's /workers")
    if args.model and not args.ray_address:  # on Ray the folder is on the worker nodes
        try:
            check_model_folder(args.model)
        except FileNotFoundError as e:
            parser.error(str(e))
    try:
        restart = RestartBackoff(max_delay=args.restart_backoff_max_secs, max_restarts=args.max_restarts)
        tool_settings_from_args(args)
        role_gpus = {role: parse_gpu_list(text) for role in ("prefill", "decode", "mixed")
                     if (text := getattr(args, f"{role}_gpus")) is not None}
        role_ports = {role: parse_port_list(text, f"--{role}-ports") for role in ("prefill", "decode", "mixed")
                      if (text := getattr(args, f"{role}_ports")) is not None}
        refuse_node_flags([f"--{k.replace('_', '-')}" for k in ("nnodes", "node_rank", "dist_init_addr", "dist_timeout")
                           if getattr(args, k, None) is not None], "pd-serve")
        role_argv = role_argv_of({"prefill": args.prefill_arg, "decode": args.decode_arg}, args.colocated)
        role_tp = role_tp_sizes(role_argv, args.tp_size)
    except ValueError as e:
        parser.error(str(e))
    spec = ClusterSpec(num_prefill=args.num_prefill, num_decode=args.num_decode, colocated=args.colocated,
                       num_workers=args.num_workers, host=args.host, router_port=args.port,
                       engine_argv=passthrough_argv(args, parser) + tool_argv(args),
                       router_argv=router_argv, shutdown_grace_period_secs=grace,
                       log_level=args.log_level, api_key=api_key, admin_api_key=admin_api_key,
                       internal_api_key=internal_api_key, restart=restart, role_gpus=role_gpus,
                       role_ports=role_ports, role_argv=role_argv, role_tp=role_tp if role_argv else {},
                       num_gpus=0 if args.ray_address else cuda_device_count(), tp_size=args.tp_size or 1,
                       mem_fraction_given=args.mem_fraction_static is not None, kv_store_size=args.kv_store_size,
                       fork_workers=args.fork_workers)
    if args.ray_address:
        if plan_kv_store(spec.engine_argv)[0] is not None:
            parser.error("--hicache-storage-backend mooncake on Ray needs a master you run: give its address as "
                         "master_server_address in --hicache-storage-backend-extra-config")
        if role_gpus or role_ports:
            parser.error("--prefill-gpus/--decode-gpus/--mixed-gpus and the --*-ports flags are for one host: Ray "
                         "places the workers itself")
        from pd_cluster.launch.ray_autoscale import AutoscaledRayCluster
        from pd_cluster.launch.ray_cluster import run_ray_cluster

        scaled = None if planner is None else AutoscaledRayCluster(args.ray_address, spec, args.tp_size, planner,
                                                                   args.planner_metrics_port)
        return run_ray_cluster(args.ray_address, spec, args, scaled)
    try:
        cluster = LocalCluster(spec) if planner is None else AutoscaledCluster(spec, planner, args.planner_metrics_port)
    except ValueError as e:  # a GPU list this host cannot satisfy, or ports that do not fit the workers
        parser.error(str(e))
    exit_now(serve_until_stopped(cluster, args.startup_timeout, args.manifest, api_key))  # skip a slow teardown
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
