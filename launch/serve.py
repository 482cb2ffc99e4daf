"""``pd-serve``: a whole PD cluster on this machine with one command.

Starts the router and N prefill + M decode workers (default 1P1D) as
subprocesses on the embedded stories260K (or ``--model``), waits until all are
healthy, prints the endpoint and an example request, and stops everything on
Ctrl-C. ``--colocated`` starts mixed workers instead. Engine flags
(``--page-size``, ``--kv-cache-dtype``, ...) and ``--kv-transfer-*`` flags
pass through to every worker; ``--router-arg=--prefill-policy=cache_aware``
passes flags to the router.
"""

from __future__ import annotations

import argparse
import sys

from pd_cluster.engine.args import ENGINE_FLAGS, add_engine_args
from pd_cluster.launch.cluster import ClusterSpec, LocalCluster
from pd_cluster.launch.supervise import serve_until_stopped


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
    p.add_argument("--log-level", default="info")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--manifest", help="write the processes' URLs and PIDs to this JSON file once ready")
    p.add_argument("--ray-address", default=None,
                   help="run the roles as Ray actors on this cluster ('local' starts one here)")
    add_engine_args(p)
    from pd_cluster.transfer.config import add_cli_args

    add_cli_args(p)
    return p


def passthrough_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Engine and transfer flags given on our command line, as argv for the workers."""
    out: list[str] = []
    names = [f.name for f in ENGINE_FLAGS] + [a.option_strings[0] for a in parser._actions
                                              if a.option_strings and a.option_strings[0].startswith("--kv-transfer")]
    for name in names:
        dest = name.lstrip("-").replace("-", "_")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    spec = ClusterSpec(num_prefill=args.num_prefill, num_decode=args.num_decode, colocated=args.colocated,
                       num_workers=args.num_workers, host=args.host, router_port=args.port,
                       engine_argv=passthrough_argv(args, parser), router_argv=list(args.router_arg),
                       log_level=args.log_level)
    if args.ray_address:
        from pd_cluster.launch.ray_cluster import run_ray_cluster

        return run_ray_cluster(args.ray_address, spec, args)
    return serve_until_stopped(LocalCluster(spec), args.startup_timeout, args.manifest)


if __name__ == "__main__":
    sys.exit(main())
