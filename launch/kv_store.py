"""The cluster-wide KV store of a local cluster: a Mooncake master and the store's memory, started by ``pd-serve``.

When the workers are given ``--hicache-storage-backend mooncake`` and no master (no ``master_server_address`` in
``--hicache-storage-backend-extra-config``, no ``MOONCAKE_MASTER``), the cluster starts two processes of its own
before the workers, both bound to loopback:

- ``kv-master``: Mooncake's ``mooncake_master`` (object metadata and allocation; ``-rpc_address 127.0.0.1``,
  free ports);
- ``kv-store``: ``pd-kv-store store`` (`lend`), a Mooncake client that lends the store ``--kv-store-size`` of memory
  (its global segment) and does nothing else, so the pages outlive any worker (the workers lend none).

The workers get the master's address in their extra config. Both are supervised like the workers (restarted
when they exit) and stopped with the cluster, after the workers. A restarted master starts empty: the workers'
clients find it again by themselves and the pages are written anew as they are computed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from pd_cluster.common.net import free_port

MASTER_NAME = "kv-master"
STORE_NAME = "kv-store"
_EXTRA = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True)
class KVStorePlan:
    """What a local cluster starts for its KV store, and the worker flags that point at it."""

    master_port: int
    metrics_port: int
    size: str
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.master_port}"

    def master_argv(self) -> list[str]:
        return master_argv(self.host, self.master_port, self.metrics_port)

    def store_argv(self) -> list[str]:
        return [sys.executable, "-m", "pd_cluster.launch.kv_store", "store", "--master", self.address, "--size",
                self.size, "--host", self.host]


def _flag_value(argv: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        flag, eq, v = arg.partition("=")
        if flag == name:
            value = v if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return value


def plan_kv_store(engine_argv: list[str], size: str = "1GiB",
                  env: dict[str, str] | None = None) -> tuple[KVStorePlan | None, list[str]]:
    """Whether the workers' flags need a master started here, and their flags pointing at it.

    Returns:
        (the plan, or None when no master is needed: no Mooncake store, or one given), the workers' argv.

    Raises:
        ValueError: the extra config is not a JSON object.
    """
    env = os.environ if env is None else env
    if _flag_value(engine_argv, "--hicache-storage-backend") != "mooncake" or env.get("MOONCAKE_MASTER"):
        return None, engine_argv
    text = _flag_value(engine_argv, _EXTRA)
    extra = json.loads(text) if text else {}
    if not isinstance(extra, dict):
        raise ValueError(f"{_EXTRA} must be a JSON object")
    if extra.get("master_server_address"):
        return None, engine_argv
    plan = KVStorePlan(free_port(), free_port(), size)
    extra = {**extra, "master_server_address": plan.address, "local_hostname": plan.host,
             "protocol": extra.get("protocol", "tcp")}
    kept: list[str] = []
    skip = False
    for arg in engine_argv:  # drop the user's extra config (merged above)
        if skip:
            skip = False
            continue
        if arg == _EXTRA:
            skip = True
            continue
        if arg.startswith(_EXTRA + "="):
            continue
        kept.append(arg)
    return plan, kept + [_EXTRA, json.dumps(extra)]


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once ``host:port`` accepts a TCP connection, False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def build_parser() -> argparse.ArgumentParser:
    """``pd-kv-store master ...`` (Mooncake's master) and ``pd-kv-store store ...`` (the memory process)."""
    ap = argparse.ArgumentParser(prog="pd-kv-store", allow_abbrev=False,
                                 description="The cluster-wide KV store's processes (Mooncake Store).")
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("master", allow_abbrev=False, help="run mooncake_master")
    m.add_argument("--host", default="127.0.0.1", help="address the master's RPC and metrics listen on")
    m.add_argument("--rpc-port", type=int, default=50051)
    m.add_argument("--metrics-port", type=int, default=9003)
    s = sub.add_parser("store", allow_abbrev=False, help="lend memory to the store until SIGTERM")
    s.add_argument("--master", required=True, help="host:port of the master")
    s.add_argument("--size", default="1GiB", help="memory lent to the store (its global segment)")
    s.add_argument("--host", default="127.0.0.1", help="this process's address for the transfer engine")
    s.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    s.add_argument("--device-name", default="", help="RDMA devices (protocol rdma)")
    return ap


def master_argv(host: str, rpc_port: int, metrics_port: int) -> list[str]:
    """``mooncake_master`` (the package's console script) bound to `host`."""
    exe = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return [exe, "-rpc_port", str(rpc_port), "-rpc_address", host, "-metrics_port", str(metrics_port),
            "-metrics_host", host, "-enable_metric_reporting=false"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "master":
        cmd = master_argv(args.host, args.rpc_port, args.metrics_port)
        os.execv(cmd[0], cmd)
    return lend(args)


def lend(args: argparse.Namespace) -> int:
    """Lend `args.size` bytes to the Mooncake store at `args.master` until SIGTERM."""
    from pd_cluster.engine.config import parse_size

    os.environ.setdefault("GLOG_minloglevel", "1")
    from mooncake.store import MooncakeDistributedStore

    host, _, port = args.master.rpartition(":")
    if not wait_for_port(host, int(port), 60):
        print(f"kv-store: the Mooncake master {args.master} does not answer", file=sys.stderr, flush=True)
        return 1
    store = MooncakeDistributedStore()
    rc = store.setup(args.host, "P2PHANDSHAKE", parse_size(args.size), 0, args.protocol, args.device_name,
                     args.master)
    if rc != 0:
        print(f"kv-store: setting up the store on {args.master} failed ({rc})", file=sys.stderr, flush=True)
        return 1
    print(f"kv-store: lending {args.size} to the Mooncake store at {args.master}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
