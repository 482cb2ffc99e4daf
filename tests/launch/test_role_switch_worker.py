"""The worker's half of role switching, in this process: `SwitchableWorker` drives stub role apps through its ASGI
lifespan (the old role stopped with the engine kept, the new one started over the same engine), waits for the old
role's HTTP calls and engine work, refuses what it cannot do, and gives up a drain past its deadline without
tearing anything down; `LLMEngine.set_role` on the real embedded model. Real role apps, NIXL and a router:
``tests/cluster/test_role_switch.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse

from pd_cluster.engine.config import EngineConfig, ParallelConfig
from pd_cluster.launch.role_switch import SwitchableWorker, _parse, config_for_role, unsupported
from pd_cluster.serving.errors import HTTPError
from pd_cluster.serving.worker_app import WorkerConfig

KEY = {"x-pd-internal-key": "k"}


class FakeEngine:
    model_name = "stories260K"
    host_tier = None
    l3 = None

    def __init__(self) -> None:
        self.role, self.requests, self.closed = "prefill", {}, False

    def set_role(self, role: str) -> None:
        self.role = role

    def close(self) -> None:
        self.closed = True


class StubState:
    """What `SwitchableWorker` reads of a role app's `WorkerState`."""

    def __init__(self, role: str) -> None:
        self.role, self.registry, self.info = role, CollectorRegistry(), {"kv_incarnation": role + "-1"}
        self.running, self.stopping, self.close_engine = 0, False, True

    @property
    def load(self) -> dict:
        return {"num_running_reqs": self.running, "num_queue_reqs": 0, "num_free_pages": 10, "num_total_pages": 10}

    def extra_load(self) -> dict:
        return {"num_prefill_inflight_queue_reqs": 0}

    def stop_taking_work(self) -> None:
        self.stopping = True

    def resume_taking_work(self) -> None:
        self.stopping = False


def _worker(base_role="prefill", **kw):
    events: list[tuple] = []
    release = asyncio.Event()
    engine = FakeEngine()
    engine.role = base_role

    def build(config: WorkerConfig):
        state = StubState(config.role)

        @contextlib.asynccontextmanager
        async def lifespan(app):
            events.append(("start", config.role, config.prefill_urls))
            yield
            events.append(("stop", config.role, state.close_engine))
            if state.close_engine:
                engine.close()

        app = FastAPI(lifespan=lifespan)
        app.state.worker = state

        async def health(request: Request):
            return JSONResponse({"role": config.role, "stopping": state.stopping})

        async def work(request: Request):
            await release.wait()
            return JSONResponse({"done": True})

        app.add_route("/health", health, ["GET"])
        app.add_route("/v1/completions", work, ["POST"])
        return app

    config = WorkerConfig(role=base_role, engine=EngineConfig(role=base_role), internal_api_key="k", **kw)
    return SwitchableWorker(engine, config, build), engine, events, release


async def _lifespan(app, kind: str) -> None:
    """Send one lifespan message (``startup`` or ``shutdown``) through a fresh lifespan call, as uvicorn would."""
    sent: list[dict] = []
    messages = asyncio.Queue()
    await messages.put({"type": f"lifespan.{kind}"})
    if kind == "startup":
        task = asyncio.ensure_future(app({"type": "lifespan"}, messages.get, lambda m: _append(sent, m)))
        while not sent:
            await asyncio.sleep(0.001)
        app._test_lifespan = (task, messages)
        assert sent[0]["type"] == "lifespan.startup.complete", sent
    else:
        task, queue = app._test_lifespan
        await queue.put({"type": "lifespan.shutdown"})
        await task


async def _append(out: list, message: dict) -> None:
    out.append(message)


@contextlib.asynccontextmanager
async def _serving(worker):
    """`worker` started (its lifespan), a client over it, then shut down."""
    await _lifespan(worker, "startup")
    transport = httpx.ASGITransport(app=worker)
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
        yield c
    await _lifespan(worker, "shutdown")


def test_switch_drains_the_old_role_then_serves_the_new_one_over_the_same_engine():
    worker, engine, events, release = _worker()

    async def run():
        async with _serving(worker) as c:
            assert (await c.get("/health")).json() == {"role": "prefill", "stopping": False}
            busy = asyncio.ensure_future(c.post("/v1/completions", json={}))
            await asyncio.sleep(0.02)
            switch = asyncio.ensure_future(c.post("/role", json={"role": "decode"}, headers=KEY))
            await asyncio.sleep(0.15)
            assert not switch.done()  # an HTTP call of the old role is in flight
            assert (await c.get("/health")).json() == {"role": "prefill", "stopping": True}
            again = await c.post("/role", json={"role": "decode"}, headers=KEY)
            assert again.status_code == 409 and again.json()["error"]["code"] == "switch_in_progress"
            release.set()
            assert (await busy).json() == {"done": True}
            r = await switch
            assert r.status_code == 200, r.text
            assert (await c.get("/health")).json() == {"role": "decode", "stopping": False}
            metrics = generate_latest(worker.app.state.worker.registry).decode()
            same = await c.post("/role", json={"role": "decode"}, headers=KEY)
        return r.json(), metrics, same.json()

    out, metrics, same = asyncio.run(run())
    assert out["role"] == "decode" and out["from_role"] == "prefill" and out["switched"] and out["switches"] == 1
    assert out["drain_secs"] >= 0.1 and out["kv_incarnation"] == "decode-1"
    assert same["switched"] is False
    assert engine.role == "decode" and engine.closed  # closed once, at the final shutdown only
    assert events == [("start", "prefill", ()), ("stop", "prefill", False), ("start", "decode", ()),
                      ("stop", "decode", True)]
    assert 'pd:role_switches_total{from_role="prefill",model_name="stories260K",to_role="decode"} 1.0' in metrics


def test_a_decode_worker_gets_its_prefill_urls_back():
    worker, engine, events, _ = _worker("decode", prefill_urls=("http://p:1",))

    async def run():
        async with _serving(worker) as c:
            for role in ("prefill", "decode"):
                assert (await c.post("/role", json={"role": role}, headers=KEY)).status_code == 200

    asyncio.run(run())
    assert [e[:3] for e in events if e[0] == "start"] == [("start", "decode", ("http://p:1",)),
                                                         ("start", "prefill", ()),
                                                         ("start", "decode", ("http://p:1",))]


def test_a_drain_past_its_deadline_keeps_the_role():
    worker, engine, events, _ = _worker()

    async def run():
        async with _serving(worker) as c:
            worker.app.state.worker.running = 1  # a request that does not end
            r = await c.post("/role", json={"role": "decode", "timeout_secs": 0.2}, headers=KEY)
            health = (await c.get("/health")).json()
        return r, health

    r, health = asyncio.run(run())
    assert r.status_code == 504 and r.json()["error"]["code"] == "switch_timeout"
    assert "1 running" in r.json()["error"]["message"]
    assert health == {"role": "prefill", "stopping": False} and engine.role == "prefill"
    assert events == [("start", "prefill", ()), ("stop", "prefill", True)]


def test_role_route_refusals():
    worker, engine, _, _ = _worker()

    async def run():
        async with _serving(worker) as c:
            out = [await c.post("/role", json={"role": "decode"}),
                   await c.post("/role", json={"role": "mixed"}, headers=KEY),
                   await c.post("/role", content=b"{", headers=KEY),
                   await c.get("/role", headers=KEY)]
        return out

    got = asyncio.run(run())
    assert [r.status_code for r in got] == [401, 400, 400, 405]
    assert got[1].json()["error"]["param"] == "role" and got[2].json()["error"]["code"] == "invalid_json"
    assert engine.role == "prefill"


@pytest.mark.parametrize("raw, param", [(b"[]", "role"), (b'{"role": 1}', "role"),
                                        (b'{"role": "decode", "timeout_secs": 0}', "timeout_secs"),
                                        (b'{"role": "decode", "timeout_secs": true}', "timeout_secs")])
def test_parse_names_the_field(raw, param):
    with pytest.raises(HTTPError) as e:
        _parse(raw)
    assert e.value.status == 400 and e.value.param == param
    assert _parse(json.dumps({"role": "decode", "timeout_secs": 3}).encode()) == ("decode", 3.0)


def test_config_for_role_and_unsupported_configurations():
    base = WorkerConfig(role="decode", engine=EngineConfig(role="decode"), prefill_url="http://p:1",
                        prefill_urls=("http://p:2",))
    prefill = config_for_role(base, "prefill")
    assert prefill.role == prefill.engine.role == "prefill"
    assert prefill.prefill_urls == () and prefill.prefill_url is None
    assert config_for_role(prefill, "decode").prefill_urls == ()  # launched as prefill: none to give back
    assert config_for_role(base, "decode") == base
    assert unsupported(FakeEngine(), base) is None
    tp = dataclasses.replace(base, engine=dataclasses.replace(base.engine, parallel=ParallelConfig(tp_size=2)))
    assert "--tp-size" in unsupported(FakeEngine(), tp)
    hicache = FakeEngine()
    hicache.host_tier = object()
    assert "--enable-hierarchical-cache" in unsupported(hicache, base)


def test_engine_set_role_in_place():
    from pd_cluster.engine.llm import LLM
    from pd_cluster.engine.sampling.params import SamplingParams

    engine = LLM(kv_cache_memory="8MiB", role="prefill").engine
    with pytest.raises(ValueError, match="prefill or decode"):
        engine.set_role("mixed")
    engine.add_request("r", "Once upon a time", SamplingParams(max_tokens=4, temperature=0))
    with pytest.raises(RuntimeError, match="idle"):
        engine.set_role("decode")
    engine.abort_request("r")
    while engine.has_work():
        engine.step()
    engine.set_role("decode")
    assert (engine.role, engine.config.role, engine.scheduler.role, engine.outputs.role, engine.limits.role) == \
        ("decode",) * 5
    engine.set_role("prefill")
    assert engine.scheduler.drafter is None and engine.limits.role == "prefill"
