"""``pd-serve``'s per-role engine flags: ``--prefill-arg=FLAG`` and ``--decode-arg=FLAG``.

A per-role flag goes to that role's workers after the flags given to every worker (``pd-serve --tp-size 2``), so it
overrides the same plain flag for that role (argparse keeps the last value), as SGLang's and vLLM's launchers are
given one command line per role. ``--prefill-arg=--tp-size=2 --decode-arg=--tp-size=1`` runs a TP-2 prefill worker
and a TP-1 decode worker; the KV transfer converts between them (`pd_cluster.transfer.tp_plan`).

Refused at start-up, naming the flag:

- a flag no worker takes (a typo, a router flag);
- a flag ``pd-serve`` sets for each worker itself (``--role``, ``--port``, ``--host``, ...);
- a flag whose value must be the same on both roles, because the pages or the answers would differ (``--model``,
  ``--page-size``, ``--kv-cache-dtype``, ...): give it to ``pd-serve`` itself;
- the flags of an instance over several nodes (``--nnodes``, ...): ``pd-serve`` starts every worker on one host;
- a flag with no meaning for the role (``--max-local-prefill-length`` is the decode role's), and per-role flags with
  ``--colocated`` (mixed workers have no prefill or decode role).
"""

from __future__ import annotations

import argparse
import shlex

from pd_cluster.engine.args import add_engine_args
from pd_cluster.transfer.config import add_cli_args

ROLES = ("prefill", "decode")

MANAGED = ("--role", "--disaggregation-mode", "--host", "--port", "--advertise-url", "--prefill-url",
           "--prefill-urls", "--internal-api-key", "--internal-api-key-protects-v1", "--log-level")
SAME_ON_EVERY_ROLE = ("--model", "--model-path", "--tokenizer", "--tokenizer-path", "--dtype", "--load-format",
                      "--seed", "--random-seed", "--served-model-name", "--generation-config", "--page-size",
                      "--kv-cache-dtype", "--context-length", "--max-model-len")
ROLE_ONLY = {"--max-local-prefill-length": "decode"}
NODE_FLAGS = ("--nnodes", "--node-rank", "--dist-init-addr", "--dist-timeout")
"""An instance over several nodes: pd-serve starts every worker on one host, so these are refused (give them to
``pd-worker`` on each node, or use the chart's LeaderWorkerSet; ``docs/deploy.md``)."""


def refuse_node_flags(argv: list[str], where: str) -> None:
    """Raise ValueError naming the first of `NODE_FLAGS` in `argv` (given `where`: ``pd-serve`` or ``--decode-arg``).

    Raises:
        ValueError: a flag of an instance over several nodes.
    """
    for name in _flag_names(argv):
        if name in NODE_FLAGS:
            raise ValueError(f"{where} {name}: pd-serve starts every worker on this host; an instance over several "
                             f"nodes is started with pd-worker on each node (--nnodes, --node-rank, --dist-init-addr) "
                             f"or the Helm chart's LeaderWorkerSet")


def _flag_names(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_engine_args(p)
    add_cli_args(p)
    return p


def role_argv_of(values: dict[str, list[str]], colocated: bool) -> dict[str, list[str]]:
    """Each role's extra worker flags from its ``--<role>-arg`` values (each may hold several words, shell-quoted).

    Raises:
        ValueError: naming the refused flag and the reason (module doc).
    """
    out: dict[str, list[str]] = {}
    for role in ROLES:
        given = values.get(role) or []
        if given and colocated:
            raise ValueError(f"--{role}-arg has no meaning with --colocated (mixed workers have no {role} role)")
        argv = [word for value in given for word in shlex.split(value)]
        refuse_node_flags(argv, f"--{role}-arg")
        for name in _flag_names(argv):
            if name in MANAGED:
                raise ValueError(f"--{role}-arg={name}: pd-serve sets {name} for each worker itself")
            if name in SAME_ON_EVERY_ROLE:
                raise ValueError(f"--{role}-arg={name}: {name} must be the same on the prefill and decode workers "
                                 f"(their KV pages and answers must agree); give it to pd-serve itself")
            other = ROLE_ONLY.get(name)
            if other is not None and other != role:
                raise ValueError(f"--{role}-arg={name}: {name} has no meaning for a {role} worker (only {other})")
        try:
            _, unknown = _parser().parse_known_args(argv)
        except argparse.ArgumentError as e:
            raise ValueError(f"--{role}-arg: {e}") from None
        if unknown:
            raise ValueError(f"--{role}-arg: {unknown[0]!r} is not a worker flag")
        if argv:
            out[role] = argv
    return out


def role_tp_sizes(role_argv: dict[str, list[str]], tp_size: int | None) -> dict[str, int]:
    """Each role's ``--tp-size``: its own per-role flag (the last wins), else the plain flag, else 1."""
    out = {}
    for role in (*ROLES, "mixed"):
        ns, _ = _parser().parse_known_args(role_argv.get(role, []))
        out[role] = ns.tp_size or tp_size or 1
    return out
