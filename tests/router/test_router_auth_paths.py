"""``--api-key`` guards ``/v1/*``, as vLLM's does (so lm-eval's remote tokenizer, which sends only the OpenAI key to
``/v1`` and none to ``/tokenizer_info``, works); ``--api-key-protects-all-paths`` guards every path but the probes.
The router's control plane in this process (no worker: the tokenizer calls answer 503)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_cluster.router.app import RouterApp
from pd_cluster.router.args import parse_config

KEY = "sk-test"


def answers(flags: list[str], calls: list[tuple[str, str, dict]]) -> list[int]:
    app = RouterApp(parse_config(["--api-key", KEY, *flags])).control

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return [(await client.request(method, path, headers=headers, json={"prompt": "x"}
                                          if method == "POST" else None)).status_code
                    for method, path, headers in calls]

    return asyncio.run(run())


OTHERS = [("GET", "/tokenizer_info", {}), ("POST", "/tokenize", {}), ("POST", "/detokenize", {}),
          ("GET", "/metrics", {}), ("GET", "/version", {}), ("GET", "/openapi.json", {}), ("GET", "/nowhere", {})]
PROBES = [("GET", "/health", {}), ("GET", "/readiness", {})]
AUTH = {"authorization": f"Bearer {KEY}"}


def test_by_default_only_v1_needs_the_key():
    got = answers([], [("GET", "/v1/models", {}), ("GET", "/v1/models", AUTH)] + OTHERS + PROBES)
    assert got[:2] == [401, 200]
    assert got[2:5] == [503, 503, 503]  # no worker to answer, but no 401
    assert 401 not in got[2:]


def test_with_all_paths_every_path_but_the_probes_needs_it():
    got = answers(["--api-key-protects-all-paths"], OTHERS + PROBES + [("GET", "/v1/models", {})])
    assert got[:len(OTHERS)] == [401] * len(OTHERS)
    assert got[len(OTHERS):len(OTHERS) + 2] != [401, 401] and 401 not in got[len(OTHERS):len(OTHERS) + 2]
    assert got[-1] == 401
    with_key = answers(["--api-key-protects-all-paths"], [(m, p, AUTH) for m, p, _ in OTHERS])
    assert with_key == [503, 503, 503, 200, 200, 200, 404]


def test_all_paths_needs_a_key(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--api-key-protects-all-paths"])
    assert "--api-key-protects-all-paths needs --api-key" in capsys.readouterr().err
