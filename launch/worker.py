"""``pd-worker``: one worker of any role, serving HTTP on ``--host``/``--port``.

Examples::

    pd-worker --role mixed --port 30000
    pd-worker --role prefill --port 30001 --kv-cache-dtype fp8_e4m3
    pd-worker --role decode --port 30002 --kv-cache-dtype fp8_e4m3

SGLang's ``--disaggregation-mode prefill|decode|null`` is accepted for ``--role``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from pd_cluster.engine.args import add_engine_args, config_from_args

ROLE_ALIASES = {"null": "mixed", "prefill": "prefill", "decode": "decode", "mixed": "mixed"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-worker", description="Run one pd-cluster worker.")
    p.add_argument("--role", choices=["prefill", "decode", "mixed"], default=None)
    p.add_argument("--disaggregation-mode", choices=["prefill", "decode", "null"], default=None,
                   help="SGLang's name for --role (null = mixed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--advertise-url", default=None,
                   help="URL peers use to reach this worker (default http://HOST:PORT)")
    p.add_argument("--prefill-url", default=None,
                   help="decode: the prefill worker for requests without an X-PD-Prefill-Url header")
    p.add_argument("--log-level", default="info")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="seconds to drain requests in flight on SIGTERM")
    add_engine_args(p)
    from pd_cluster.transfer.config import add_cli_args as add_transfer_args

    add_transfer_args(p)
    return p


def resolve_role(args: argparse.Namespace) -> str:
    if args.role and args.disaggregation_mode and ROLE_ALIASES[args.disaggregation_mode] != args.role:
        raise SystemExit("pd-worker: --role and --disaggregation-mode disagree")
    return args.role or ROLE_ALIASES.get(args.disaggregation_mode or "null", "mixed")


def build_app(args: argparse.Namespace):
    """Build the engine and the role's app from parsed flags."""
    import dataclasses

    from pd_cluster.engine.llm_engine import LLMEngine

    role = resolve_role(args)
    config = dataclasses.replace(config_from_args(args), role=role)
    engine = LLMEngine(config)
    url = args.advertise_url or f"http://{args.host}:{args.port}"
    info = {"url": url, "incarnation": uuid.uuid4().hex[:12]}
    if role == "mixed":
        from pd_cluster.serving.mixed import build_mixed_app

        return build_mixed_app(engine, info)
    if role == "prefill":
        from pd_cluster.prefill.server import build_prefill_app

        return build_prefill_app(engine, args, info)
    from pd_cluster.decode.server import build_decode_app

    return build_decode_app(engine, args, info)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    app = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=args.timeout_graceful_shutdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
