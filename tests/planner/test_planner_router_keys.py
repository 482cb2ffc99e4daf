"""The planner's keys against the router's real control plane (``router.control``, served by uvicorn on loopback
in a thread of this process): under ``--api-key-protects-all-paths`` the router's ``/metrics`` wants the API key and
``/workers`` the admin key. The planner sends each where it belongs; with a key missing, ``pd-planner`` stops at
start-up naming the flag, instead of running with every decision frozen."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from pd_cluster.common.net import free_port
from pd_cluster.planner import main as planner_main
from pd_cluster.planner.scrape import MetricsSource
from pd_cluster.router.app import RouterApp
from pd_cluster.router.args import parse_config

API_KEY, ADMIN_KEY = "sk-planner-test", "admin-planner-test"


@pytest.fixture(scope="module")
def router_url():
    config = parse_config(["--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--api-key-protects-all-paths"])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(RouterApp(config).control, host="127.0.0.1", port=port,
                                           log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_planner_sends_the_api_key_to_metrics_and_the_admin_key_to_workers(router_url):
    view = MetricsSource(router_url, ADMIN_KEY, api_key=API_KEY).fetch()
    assert view.snapshot.missing == ()
    assert view.snapshot.router_queued == 0  # the router's own pd_router_queue_depth, read with the API key
    source = MetricsSource(router_url, ADMIN_KEY, api_key=API_KEY)
    assert source.refusals() == {}


def test_a_missing_key_names_the_refusing_path_and_its_status(router_url):
    assert MetricsSource(router_url, ADMIN_KEY).fetch().snapshot.missing == ("router /metrics (401)",)
    assert MetricsSource(router_url, ADMIN_KEY).refusals() == {"/metrics": 401}
    assert MetricsSource(router_url, None, api_key=API_KEY).refusals() == {"/workers": 401}
    assert MetricsSource("http://127.0.0.1:1").refusals() == {}  # no answer: an outage, not a refusal


@pytest.mark.parametrize("argv, flag", [
    (["--admin-api-key", ADMIN_KEY], "--api-key"),
    (["--api-key", API_KEY], "--admin-api-key"),
    (["--admin-api-key", ADMIN_KEY, "--api-key", "wrong"], "--api-key"),
])
def test_pd_planner_refuses_to_start_with_a_key_the_router_refuses(router_url, capsys, monkeypatch, argv, flag):
    monkeypatch.delenv(planner_main.API_KEY_ENV, raising=False)
    monkeypatch.delenv(planner_main.ADMIN_API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit) as e:
        planner_main.main(["--router-url", router_url, "--port", str(free_port()), *argv])
    assert e.value.code == 2
    path = "/metrics" if flag == "--api-key" else "/workers"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"pd-planner: error: {flag}: the router at {router_url} answers 401 to the planner's GET {path}; give its "
        f"key ({flag} or env PD_ROUTER_{'API' if flag == '--api-key' else 'ADMIN_API'}_KEY), or every decision "
        f"stays frozen")
