"""``pd-worker``: one worker of any role, serving HTTP on ``--host``/``--port``.

Examples::

    pd-worker --role mixed --port 30000
    pd-worker --role prefill --port 30001 --kv-cache-dtype fp8_e4m3
    pd-worker --role decode --port 30002 --kv-cache-dtype fp8_e4m3

SGLang's ``--disaggregation-mode prefill|decode|null`` is accepted for ``--role``.

An instance over two nodes (SGLang's flags; node 1 runs its ranks and serves no API, `pd_cluster.launch.node`)::

    pd-worker --role decode --tp-size 16 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:20000
    pd-worker --role decode --tp-size 16 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:20000

In a LeaderWorkerSet pod, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX`` and ``LWS_LEADER_ADDRESS`` give ``--nnodes``,
``--node-rank`` and ``--dist-init-addr LEADER:20000`` where those flags are not given (a flag wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import uuid

import uvicorn

from pd_cluster.common.process import exit_now
from pd_cluster.engine.args import add_engine_args, config_from_args
from pd_cluster.engine.executor.rank_procs import stop_rank_processes
from pd_cluster.engine.parallel.nodes import lws_node_args
from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda
from pd_cluster.serving.tools.chat import add_tool_args, tool_settings_from_args
from pd_cluster.serving.worker_app import WorkerAppBuilder, WorkerConfig
from pd_cluster.transfer.config import add_cli_args as add_transfer_args
from pd_cluster.transfer.config import from_cli_args

INTERNAL_API_KEY_ENV = "PD_INTERNAL_API_KEY"


class DrainedServer(uvicorn.Server):
    """Exits 0 after the graceful shutdown a SIGINT/SIGTERM started (uvicorn re-raises the captured signal
    afterwards: a KeyboardInterrupt traceback for SIGINT, death by the signal for SIGTERM)."""

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()  # the drain is the answer to the signal

ROLE_ALIASES = {"null": "mixed", "prefill": "prefill", "decode": "decode", "mixed": "mixed"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="pd-worker", description="Run one pd-cluster worker.")
    p.add_argument("--role", choices=["prefill", "decode", "mixed"], default=None)
    p.add_argument("--disaggregation-mode", choices=["prefill", "decode", "null"], default=None,
                   help="SGLang's name for --role (null = mixed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--advertise-url", default=None,
                   help="URL peers use to reach this worker (default http://HOST:PORT)")
    p.add_argument("--prefill-url", default=None,
                   help="decode: the prefill worker for requests without an X-PD-Prefill-Url header")
    p.add_argument("--prefill-urls", nargs="+", default=[], metavar="URL",
                   help="decode: the prefill workers an X-PD-Prefill-Url header may name (requests that carry "
                        "the internal key, i.e. from the router, may name any)")
    p.add_argument("--internal-api-key", default=None,
                   help=f"the cluster's shared internal key, required on /prefill, /abort and /kv_transfer/* and "
                        f"sent to peers (prefer env {INTERNAL_API_KEY_ENV}: it stays off the command line)")
    p.add_argument("--internal-api-key-protects-v1", action="store_true",
                   help="also require the internal key on /v1/*, /tokenize and /detokenize (only the router, "
                        "or a client holding the key as its Bearer key, may call this worker's API)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="seconds to drain requests in flight on SIGTERM")
    add_tool_args(p)
    add_engine_args(p)
    add_transfer_args(p)
    return p


def resolve_role(args: argparse.Namespace) -> str:
    if args.role and args.disaggregation_mode and ROLE_ALIASES[args.disaggregation_mode] != args.role:
        raise SystemExit("pd-worker: --role and --disaggregation-mode disagree")
    return args.role or ROLE_ALIASES.get(args.disaggregation_mode or "null", "mixed")


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The frozen `WorkerConfig` of parsed ``pd-worker`` flags.

    Raises:
        ValueError: an invalid engine, transfer or worker value (from the config dataclasses).
        SystemExit: ``--role`` and ``--disaggregation-mode`` disagree.
    """
    role = resolve_role(args)
    # a LeaderWorkerSet pod: the node flags not given come from LWS_* (explicit flags win, flag by flag)
    args.nnodes, args.node_rank, args.dist_init_addr = lws_node_args(os.environ, args.nnodes, args.node_rank,
                                                                     args.dist_init_addr)
    return WorkerConfig(role=role, host=args.host, port=args.port, advertise_url=args.advertise_url,
                        prefill_url=args.prefill_url, log_level=args.log_level,
                        prefill_urls=tuple(u.rstrip("/") for u in args.prefill_urls),
                        internal_api_key=args.internal_api_key or os.environ.get(INTERNAL_API_KEY_ENV) or None,
                        internal_api_key_protects_v1=args.internal_api_key_protects_v1,
                        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                        engine=dataclasses.replace(config_from_args(args), role=role),
                        transfer=from_cli_args(args),
                        tools=tool_settings_from_args(args))


def build_app(config: WorkerConfig):
    """Build the engine and the role's app (with `InternalAuth` when there is an internal key); a prefill or
    decode worker's app is a `SwitchableWorker`, which can switch between those roles (``POST /role``).

    The UCX network devices are pinned to `config.host`'s interface first (`ucx_env.bind_to_host`), so the
    KV transfer listeners bind the worker's own address.
    """
    from pd_cluster.serving.worker_app import install_internal_auth
    from pd_cluster.transfer import ucx_env

    if config.engine.parallel.enable_dp_attention:  # N DP rank processes behind rank 0's app; no role switch
        if config.role != "decode":
            raise ValueError(f"--enable-dp-attention is built for decode workers (and the offline engine), not "
                             f"--role {config.role} yet")
        ucx_env.bind_to_host(config.host, config.transfer)
        from pd_cluster.decode.dp_instance import build_dp_decode_app

        return build_dp_decode_app(config)
    if config.role == "mixed":
        return install_internal_auth(_build_role_app(config), config)
    ucx_env.bind_to_host(config.host, config.transfer)
    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.launch.role_switch import SwitchableWorker

    engine = LLMEngine(config.engine)

    def build(role_config: WorkerConfig):
        app = role_app_builder(role_config.role)(engine, role_config,
                                                 {"url": role_config.url, "incarnation": uuid.uuid4().hex[:12]})
        return install_internal_auth(app, role_config)

    return SwitchableWorker(engine, config, build)


def role_app_builder(role: str) -> WorkerAppBuilder:
    """The app builder of `role`, imported on demand (a worker loads only its own role's code). Every role's has
    one signature (`WorkerAppBuilder`)."""
    if role == "prefill":
        from pd_cluster.prefill.server import build_prefill_app

        return build_prefill_app
    if role == "decode":
        from pd_cluster.decode.server import build_decode_app

        return build_decode_app
    from pd_cluster.serving.mixed import build_mixed_app

    return build_mixed_app


def _build_role_app(config: WorkerConfig):
    from pd_cluster.engine.llm_engine import LLMEngine

    build = role_app_builder(config.role)
    engine = LLMEngine(config.engine)
    return build(engine, config, {"url": config.url, "incarnation": uuid.uuid4().hex[:12]})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = worker_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.trust_remote_code:
        logging.getLogger("pd.worker").info("--trust-remote-code has no effect: pd-cluster runs no code "
                                            "from a checkpoint")
    if config.engine.device.attention_backend == "triton":
        use_triton_interpreter_without_cuda()  # before the kernels are imported
    if config.engine.parallel.node_rank > 0:  # a node of an instance whose rank 0 runs elsewhere: no API here
        from pd_cluster.launch.node import serve_node

        return serve_node(config)
    from pd_cluster.engine.parallel.rendezvous import NodeJoinError

    try:
        app = build_app(config)
    except (FileNotFoundError, NodeJoinError, ValueError) as e:  # a Hub id, a node that did not join, a refused
        # setting: one line
        print(f"pd-worker: error: {e}", file=sys.stderr)
        return 2
    DrainedServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                                 access_log=False, timeout_graceful_shutdown=config.timeout_graceful_shutdown)).run()
    stop_rank_processes()  # gone before this process: whoever waits for its exit finds none of them answering
    exit_now(0)  # the server drained and shut down: skip seconds of interpreter and torch teardown
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
