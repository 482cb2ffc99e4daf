"""The router's half of a planner's scale-down, in this process: ``POST /workers/{id}/drain`` stops routing to the
worker at once, answers once the router's own requests on it have left, refuses an unknown id and the last worker of
a role in OpenAI's format, gives up past its timeout (the worker takes work again), and ``DELETE
/workers/{id}/drain`` gives a drain up. (The whole scale-down on real processes: tests/cluster/test_autoscale.py.)"""

from __future__ import annotations

import asyncio

import httpx

from pd_cluster.router.config import Role
from pd_cluster.router.workers import worker_id
from test_role_switch_units import D0, P0, P1, _router


async def _request(control, method, path, during=None, **kw):
    transport = httpx.ASGITransport(app=control)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        task = asyncio.ensure_future(client.request(method, path, **kw))
        if during is not None:
            await during()
        return await task


def test_drain_stops_routing_at_once_and_waits_for_the_routers_requests():
    app, _, control = _router()
    p0 = app.registry.get(P0)
    p0.inflight = 2
    seen = {}

    async def during():
        await asyncio.sleep(0.05)
        seen["usable"] = [w.url for w in app.registry.usable(Role.PREFILL)]
        seen["draining"] = p0.draining
        p0.inflight = 0  # the router's requests on it end

    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(P0)}/drain", during))
    assert r.status_code == 200, r.text
    assert seen == {"usable": [P1], "draining": True}
    body = r.json()
    assert body["id"] == worker_id(P0) and body["draining"] is True and body["inflight"] == 0
    assert body["drain_secs"] >= 0.04
    assert [w.url for w in app.registry.usable(Role.PREFILL)] == [P1]  # stays out until removed
    listed = asyncio.run(_request(control, "GET", "/workers")).json()["workers"]
    assert {w["url"]: w["draining"] for w in listed} == {P0: True, P1: False, D0: False}
    r = asyncio.run(_request(control, "DELETE", f"/workers/{worker_id(P0)}/drain"))
    assert r.status_code == 200 and r.json()["draining"] is False
    assert sorted(w.url for w in app.registry.usable(Role.PREFILL)) == [P0, P1]


def test_drain_refusals_and_timeout():
    app, _, control = _router()
    r = asyncio.run(_request(control, "POST", "/workers/wnosuchworker/drain"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(D0)}/drain"))
    err = r.json()["error"]
    assert r.status_code == 409 and err["code"] == "would_leave_no_worker" and "no decode worker" in err["message"]
    app.registry.get(P0).inflight = 1  # never leaves
    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(P0)}/drain", params={"timeout_secs": 0.05}))
    assert r.status_code == 504 and r.json()["error"]["code"] == "drain_timeout", r.text
    assert not app.registry.get(P0).draining
    app.registry.get(P0).inflight = 0
    assert asyncio.run(_request(control, "POST", f"/workers/{worker_id(P0)}/drain")).status_code == 200
    # with P0 draining, P1 is the last prefill worker: neither a drain nor a switch may take it
    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(P1)}/drain"))
    assert r.status_code == 409 and "no prefill worker" in r.json()["error"]["message"]
    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(P1)}/role", json={"role": "decode"}))
    assert r.status_code == 409 and r.json()["error"]["code"] == "would_leave_no_worker"
    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(P0)}/role", json={"role": "decode"}))
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_draining"


def test_the_admin_key_guards_the_drain():
    app, _, control = _router(["--api-key", "k", "--admin-api-key", "admin"])
    r = asyncio.run(_request(control, "POST", f"/workers/{worker_id(P0)}/drain"))
    assert r.status_code == 401
    r = asyncio.run(_request(control, "DELETE", f"/workers/{worker_id(P0)}/drain"))
    assert r.status_code == 401
    assert not app.registry.get(P0).draining


def test_a_method_the_drain_path_does_not_take_is_answered_405_allowing_both_of_its_methods():
    """Two routes serve the path (POST and DELETE): a 405 names both in ``Allow``, not only the first route's."""
    _, _, control = _router()
    for method in ("OPTIONS", "GET", "PUT"):
        r = asyncio.run(_request(control, method, f"/workers/{worker_id(P0)}/drain"))
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, POST", (method, r.headers)
        assert r.json()["error"]["code"] == "method_not_allowed"
    r = asyncio.run(_request(control, "PUT", "/workers"))  # one route's path keeps its own methods
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) >= {"GET", "POST", "DELETE"}, r.headers
