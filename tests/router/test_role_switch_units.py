"""The router's half of role switching, in this process: stable worker ids, ``POST /workers/{id}/role``'s refusals in
OpenAI's format, routing stopped at once and the router's own in-flight requests waited for, re-registration under
the new role, and a failed switch that leaves the worker in its role. The worker's call is replaced by a stub
(the switch on real workers: ``tests/cluster/test_role_switch.py``)."""

from __future__ import annotations

import asyncio
import re

import httpx

from pd_cluster.router.app import RouterApp
from pd_cluster.router.args import parse_config
from pd_cluster.router.config import Role
from pd_cluster.router.control import ControlPlane
from pd_cluster.router.role_switch import RoleSwitcher, SwitchRefused
from pd_cluster.router.workers import worker_id

P0, P1, D0 = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"


class Monitor:
    """The health monitor's `check`, answering healthy (the new role's first check)."""

    def __init__(self) -> None:
        self.checked: list[str] = []

    async def check(self, worker) -> bool:
        self.checked.append(worker.url)
        worker.healthy = worker.checked = True
        return True


class StubSwitcher(RoleSwitcher):
    """Records the state seen when the worker is called; answers like a worker, or raises `fail`."""

    def __init__(self, *a, fail: SwitchRefused | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.fail = fail
        self.seen: list[dict] = []

    async def _call_worker(self, worker, role, timeout):
        self.seen.append({"usable_prefill": [w.url for w in self.registry.usable(Role.PREFILL)],
                          "inflight": worker.inflight, "role": role.value})
        await asyncio.sleep(0.01)
        if self.fail is not None:
            raise self.fail
        return {"role": role.value, "drain_secs": 0.01}


def _router(flags=(), fail=None, sources=None):
    app = RouterApp(parse_config(list(flags)))
    for url, role in ((P0, Role.PREFILL), (P1, Role.PREFILL), (D0, Role.DECODE)):
        app.registry.add(url, role, (sources or {}).get(url, "static"), healthy=True)
    monitor = Monitor()
    switcher = StubSwitcher(app.config, app.registry, monitor, app.metrics, poll_s=0.005, fail=fail)
    control = ControlPlane(app.config, app.registry, monitor, app.metrics, app.models, lambda: False,
                           lambda: True, switcher=switcher).build()
    return app, switcher, control


async def _calls(control, calls, during=None):
    transport = httpx.ASGITransport(app=control)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        out = []
        for method, path, body, headers in calls:
            task = asyncio.ensure_future(client.request(method, path, json=body, headers=headers or {}))
            if during is not None:
                await during()
            out.append(await task)
        return out


def _post(wid, role, headers=None):
    return ("POST", f"/workers/{wid}/role", {"role": role}, headers)


def test_ids_are_stable_and_derived_from_the_url():
    assert re.fullmatch(r"w[0-9a-f]{12}", worker_id(P0))
    assert worker_id(P0 + "/") == worker_id(P0) != worker_id(P1)
    app, _, control = _router()
    w = app.registry.get(P0)
    assert w.id == worker_id(P0) and app.registry.by_id(w.id) is w and app.registry.by_id("wnope") is None
    w.healthy, w.dead = False, True  # health changes keep it
    assert w.describe(0.0)["id"] == worker_id(P0)
    app.registry.remove(P0)
    assert app.registry.add(P0, Role.PREFILL, "admin").id == worker_id(P0)  # re-added: the same id
    (r,) = asyncio.run(_calls(control, [("GET", "/workers", None, None)]))
    assert {x["url"]: x["id"] for x in r.json()["workers"]} == {u: worker_id(u) for u in (P0, P1, D0)}


def test_refusals_are_openai_errors():
    app, switcher, control = _router(sources={P1: "kubernetes"})
    ids = {u: worker_id(u) for u in (P0, P1, D0)}
    got = asyncio.run(_calls(control, [
        _post("wnosuchworker", "decode"), _post(ids[P0], "mixed"), ("POST", f"/workers/{ids[P0]}/role", {}, None),
        ("POST", f"/workers/{ids[P0]}/role", {"role": 5}, None), _post(ids[D0], "prefill"),
        _post(ids[P1], "decode"), _post(ids[D0], "decode")]))
    errors = [r.json().get("error") for r in got]
    assert [r.status_code for r in got] == [404, 400, 400, 400, 409, 409, 200]
    assert errors[0]["code"] == "worker_not_found" and errors[0]["type"] == "invalid_request_error"
    assert all(e["param"] == "role" for e in errors[1:4])
    assert errors[4]["code"] == "would_leave_no_worker" and "no decode worker" in errors[4]["message"]
    assert errors[5]["code"] == "discovered_worker" and "kubernetes" in errors[5]["message"]
    assert got[6].json()["switched"] is False
    assert switcher.seen == []  # no worker was called
    assert all(w.switching is None for w in app.registry.all())


def test_a_mixed_worker_has_no_role_to_switch():
    app, _, control = _router()
    app.registry.add("http://127.0.0.1:9009", Role.MIXED, "static", healthy=True)
    (r,) = asyncio.run(_calls(control, [_post(worker_id("http://127.0.0.1:9009"), "decode")]))
    assert r.status_code == 400 and "mixed worker" in r.json()["error"]["message"]


def test_the_admin_key_guards_it():
    _, switcher, control = _router(["--admin-api-key", "adm"])
    got = asyncio.run(_calls(control, [_post(worker_id(P0), "decode"),
                                       _post(worker_id(P0), "decode", {"authorization": "Bearer adm"})]))
    assert [r.status_code for r in got] == [401, 200]
    assert len(switcher.seen) == 1


def test_switch_stops_routing_at_once_waits_for_inflight_and_reregisters():
    app, switcher, control = _router()
    p0 = app.registry.get(P0)
    p0.inflight = 2  # two of this router's requests still use it as their prefill

    async def during():
        await asyncio.sleep(0.02)
        assert p0.switching is Role.DECODE and P0 not in [w.url for w in app.registry.usable(Role.PREFILL)]
        assert switcher.seen == []  # not called while the router's requests are on it
        p0.inflight = 0

    (r,) = asyncio.run(_calls(control, [_post(p0.id, "decode")], during))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["switched"] and body["role"] == "decode" and body["from_role"] == "prefill" and body["id"] == p0.id
    assert body["worker"] == {"role": "decode", "drain_secs": 0.01} and body["switch_secs"] >= body["router_drain_secs"]
    assert switcher.seen == [{"usable_prefill": [P1], "inflight": 0, "role": "decode"}]
    again = app.registry.get(P0)
    assert again.role is Role.DECODE and again.id == p0.id and again.source == "static" and again.switching is None
    assert [w.url for w in app.registry.usable(Role.DECODE)] == [D0, P0]
    assert switcher.monitor.checked == [P0]
    text = app.metrics.render().decode()
    assert re.search(r'pd_router_role_switches_total\{[^}]*from_role="prefill"[^}]*outcome="ok"[^}]*'
                     r'to_role="decode"\} 1\.0', text)
    assert re.search(r'pd_router_role_switch_duration_seconds_count\{[^}]*\} 1\.0', text)
    # now P1 is the last prefill worker: it may not leave
    (r,) = asyncio.run(_calls(control, [_post(worker_id(P1), "decode")]))
    assert r.status_code == 409 and "no prefill worker" in r.json()["error"]["message"]


def test_a_failed_switch_leaves_the_worker_in_its_role():
    body = b'{"error": {"message": "drain timed out", "type": "server_error", "param": null, "code": "switch_timeout"}}'
    app, switcher, control = _router(fail=SwitchRefused(504, "refused", body=body))
    (r,) = asyncio.run(_calls(control, [_post(worker_id(P0), "decode")]))
    assert r.status_code == 504 and r.json()["error"]["code"] == "switch_timeout"
    p0 = app.registry.get(P0)
    assert p0.role is Role.PREFILL and p0.switching is None and P0 in [w.url for w in app.registry.usable(Role.PREFILL)]
    assert 'outcome="failed"' in app.metrics.render().decode()


def _while_p0_switches(during):
    """P0 asked to switch to decode while one of the router's requests holds it; then
    ``during(client, call, p0, registry)``."""
    app, switcher, control = _router()
    p0 = app.registry.get(P0)
    p0.inflight = 1

    async def run():
        transport = httpx.ASGITransport(app=control)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            call = asyncio.ensure_future(client.post(f"/workers/{p0.id}/role", json={"role": "decode"}))
            await asyncio.sleep(0.02)
            return await during(client, call, p0, app.registry)

    return app, switcher, asyncio.run(run())


def test_a_second_switch_of_a_switching_worker_is_refused():
    async def during(client, call, p0, registry):
        second = await client.post(f"/workers/{p0.id}/role", json={"role": "decode"})
        p0.inflight = 0
        return await call, second

    _, _, (first, second) = _while_p0_switches(during)
    assert first.status_code == 200
    assert second.status_code == 409 and second.json()["error"]["code"] == "switch_in_progress"


def test_a_caller_that_goes_away_does_not_leave_the_worker_half_switched():
    async def during(client, call, p0, registry):
        call.cancel()  # the admin client gives up while the router waits for its request on the worker
        await asyncio.sleep(0.01)
        p0.inflight = 0
        for _ in range(200):  # bounded: the switch ends on its own
            if registry.get(P0).role is Role.DECODE:
                return True
            await asyncio.sleep(0.01)
        return False

    app, switcher, done = _while_p0_switches(during)
    assert done and app.registry.get(P0).switching is None and switcher.seen[0]["role"] == "decode"
