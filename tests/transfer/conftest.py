"""Fixtures of the KV transfer tests: worker processes that are always ended, and real prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # the spawned workers import kv_peer / kv_model by these names
    sys.path.insert(0, HERE)

from kv_peer import Peer, PeerProcess, PeerSpec  # noqa: E402


class Launcher:
    """Starts worker processes in parallel and ends them all at teardown."""

    def __init__(self) -> None:
        self.processes: list[PeerProcess] = []

    def start(self, *specs: PeerSpec) -> list[Peer]:
        """One process per spec, started together; returns their workers in order."""
        procs = [PeerProcess([s]) for s in specs]
        self.processes += procs
        return [p.ready()[0] for p in procs]

    def start_multi(self, *groups: list[PeerSpec]) -> list[list[Peer]]:
        """One process per group of specs (several pools in one process), started together."""
        procs = [PeerProcess(g) for g in groups]
        self.processes += procs
        return [p.ready() for p in procs]

    def close(self) -> None:
        for p in self.processes:
            p.close()


@pytest.fixture
def launcher():
    lc = Launcher()
    yield lc
    lc.close()


@pytest.fixture(scope="module")
def module_launcher():
    lc = Launcher()
    yield lc
    lc.close()


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from pd_cluster.engine.assets import DEFAULT_MODEL

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def connect_pair(prefill: Peer, decode: Peer) -> None:
    """The handshake both ways, over HTTP: each side fetches the other's info and checks the layout."""
    decode.call("connect", prefill.url)
    prefill.call("connect", decode.url)
