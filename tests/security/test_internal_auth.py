"""The internal key's middleware, flags and plumbing, and the pinning of UCX's devices to the worker's host."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import JSONResponse

from pd_cluster.launch import worker as launch_worker
from pd_cluster.router.args import parse_config
from pd_cluster.router.config import LimitsConfig
from pd_cluster.router.upstream import Reply, Upstreams
from pd_cluster.serving.worker_app import InternalAuth, key_matches
from pd_cluster.transfer import ucx_env
from pd_cluster.transfer.config import TransferConfig

KEY = "k-0123456789abcdefghijklmnopqrstuvwxyz"


def _app(protect_v1: bool) -> FastAPI:
    app = FastAPI()
    for path in ("/v1/models", "/health", "/prefill", "/kv_transfer/info", "/tokenize"):
        app.add_route(path, lambda request, p=path: JSONResponse({"path": p}), methods=["GET", "POST"])
    app.add_middleware(InternalAuth, key=KEY, protect_v1=protect_v1)
    return app


async def _statuses(app: FastAPI, headers: dict[str, str]) -> dict[str, int]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        return {p: (await c.get(p, headers=headers)).status_code
                for p in ("/v1/models", "/health", "/prefill", "/kv_transfer/info", "/tokenize")}


def test_internal_paths_always_and_v1_only_when_asked():
    run = asyncio.run
    assert run(_statuses(_app(False), {})) == {"/v1/models": 200, "/health": 200, "/prefill": 401,
                                               "/kv_transfer/info": 401, "/tokenize": 200}
    assert run(_statuses(_app(True), {})) == {"/v1/models": 401, "/health": 200, "/prefill": 401,
                                              "/kv_transfer/info": 401, "/tokenize": 401}
    wrong = run(_statuses(_app(True), {"X-PD-Internal-Key": KEY + "x"}))
    assert wrong == {"/v1/models": 403, "/health": 200, "/prefill": 403, "/kv_transfer/info": 403, "/tokenize": 403}
    for headers in ({"X-PD-Internal-Key": KEY}, {"Authorization": f"Bearer {KEY}"}):  # a direct client: Bearer
        assert set(run(_statuses(_app(True), headers)).values()) == {200}


def test_key_comparison():
    assert key_matches(KEY, KEY) and not key_matches(KEY, KEY + "x") and not key_matches("", KEY)
    assert not key_matches(None, KEY) and not key_matches(KEY, None) and not key_matches(None, None)


def test_worker_flags_take_the_key_from_the_environment_and_keep_it_out_of_repr(monkeypatch):
    parser = launch_worker.build_parser()
    monkeypatch.setenv("PD_INTERNAL_API_KEY", KEY)
    cfg = launch_worker.worker_config_from_args(parser.parse_args(
        ["--role", "decode", "--prefill-urls", "http://p:1/", "http://p:2", "--internal-api-key-protects-v1"]))
    assert cfg.internal_api_key == KEY and cfg.internal_api_key_protects_v1
    assert cfg.prefill_urls == ("http://p:1", "http://p:2") and KEY not in repr(cfg)
    assert cfg.internal_headers == {"X-PD-Internal-Key": KEY}
    monkeypatch.delenv("PD_INTERNAL_API_KEY")
    with pytest.raises(ValueError, match="needs an internal_api_key"):
        launch_worker.worker_config_from_args(parser.parse_args(["--role", "prefill",
                                                                 "--internal-api-key-protects-v1"]))
    with pytest.raises(ValueError, match="prefill_urls is a decode"):
        launch_worker.worker_config_from_args(parser.parse_args(["--role", "prefill", "--prefill-urls", "http://p:1"]))


def test_router_sends_the_internal_key_to_workers(monkeypatch):
    monkeypatch.setenv("PD_INTERNAL_API_KEY", KEY)
    cfg = parse_config(["--decode", "http://d:1", "--prefill", "http://p:1"])
    assert cfg.security.internal_api_key == KEY and KEY not in repr(cfg)

    async def headers_sent():
        seen = []

        async def app(scope, receive, send):  # a worker that records the headers it was sent
            seen.append(dict(scope["headers"]))
            await JSONResponse({})(scope, receive, send)

        import uvicorn

        from pd_cluster.common.net import free_port
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        task = asyncio.ensure_future(server.serve())
        up = Upstreams(LimitsConfig(), cfg.security.internal_api_key)
        await up.start()
        try:
            for _ in range(100):
                if server.started:
                    break
                await asyncio.sleep(0.05)
            async with up.control.get(f"http://127.0.0.1:{port}/get_load") as r:  # probes
                assert r.status == 200
            pool = up.pool(f"http://127.0.0.1:{port}")  # generate requests
            reply = Reply(asyncio.get_running_loop())
            await pool.send(pool.frame(b"/v1/completions", b"content-type: application/json\r\n", b"{}"), reply)
            await reply.done
            assert reply.status == 200
        finally:
            await up.close()
            server.should_exit = True
            await asyncio.wait_for(task, 10)
        return seen

    seen = asyncio.run(headers_sent())
    assert [h.get(b"x-pd-internal-key") for h in seen] == [KEY.encode()] * 2


def test_ucx_devices_follow_the_worker_host(tmp_path, caplog):
    env: dict[str, str] = {}
    assert ucx_env.bind_to_host("127.0.0.1", TransferConfig(), env, sys_ib=tmp_path / "none") == "lo"
    assert env == {"UCX_NET_DEVICES": "lo"}
    assert ucx_env.bind_to_host("localhost", TransferConfig(), {}, sys_ib=tmp_path / "none") == "lo"
    assert ucx_env.bind_to_host("127.0.1.1", TransferConfig(), {}, sys_ib=tmp_path / "none") == "lo"
    ib = tmp_path / "ib"
    (ib / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (ib / "mlx5_1" / "ports" / "1").mkdir(parents=True)
    env = {}
    assert ucx_env.bind_to_host("127.0.0.1", TransferConfig(), env, sys_ib=ib) == "lo,mlx5_0:1,mlx5_1:1"
    # the operator's choice and a wildcard host are left alone
    env = {"UCX_NET_DEVICES": "eth1"}
    assert ucx_env.bind_to_host("127.0.0.1", TransferConfig(), env) is None and env == {"UCX_NET_DEVICES": "eth1"}
    env = {}
    assert ucx_env.bind_to_host("127.0.0.1", TransferConfig(ucx_net_devices="eth1"), env) is None and env == {}
    for host in ("0.0.0.0", "::"):
        assert ucx_env.bind_to_host(host, TransferConfig(), env) is None and env == {}
    with caplog.at_level(logging.WARNING):
        assert ucx_env.bind_to_host("203.0.113.77", TransferConfig(), env) is None and env == {}
    assert "no network interface holds 203.0.113.77" in caplog.text
