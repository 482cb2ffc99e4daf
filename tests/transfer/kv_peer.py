"""A minimal prefill or decode worker in its own OS process, driven by the transfer tests.

The child holds the real model, a real engine pool and page allocator, a real
`TransferAgent` (NIXL/UCX), and serves its agent info over real HTTP (uvicorn
on 127.0.0.1). Its loop is a worker's step loop: run commands from the
parent (a multiprocessing pipe), run one prefill chunk per active job, and
poll the sender or receiver, freeing pages exactly when the events say so.

`PeerProcess` is the parent's handle on a process (one or several workers,
each with its own pool and agent), `Peer` on one worker: every call is
bounded in time, and `close` always ends the process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field

CALL_TIMEOUT = 60.0
START_TIMEOUT = 180.0


@dataclass(frozen=True)
class PeerSpec:
    role: str
    kv_cache_dtype: str = "fp8_e4m3"
    page_size: int = 16
    num_pages: int = 256
    model: str | None = None
    load_format: str = "auto"
    seed: int = 0
    kv_transfer_timeout: float = 5.0
    heartbeat_interval: float = 0.2
    abort_quarantine: float | None = None
    ucx_tls: str | None = None
    port: int = 0
    device: str = "cpu"
    env: dict = field(default_factory=dict)
    speculative: dict = field(default_factory=dict)  # `AgentInfo.speculative` of the agent


class PeerCallError(RuntimeError):
    """An exception raised in the child by a command, with its type name and fields."""

    def __init__(self, info: dict) -> None:
        super().__init__(f"{info['type']}: {info['message']}")
        self.type = info["type"]
        self.message = info["message"]
        self.fields = info.get("fields")
        self.reason = info.get("reason")


# ---- the child -------------------------------------------------------------------------------------------------
class _Worker:
    def __init__(self, spec: PeerSpec) -> None:
        from prometheus_client import CollectorRegistry

        import kv_model
        from pd_cluster.engine.kv.allocator import PageAllocator
        from pd_cluster.transfer.agent import TransferAgent
        from pd_cluster.transfer.config import TransferConfig
        from pd_cluster.transfer.http import PeerDirectory
        from pd_cluster.transfer.metrics import TransferMetrics
        from pd_cluster.transfer.receiver import KVReceiver
        from pd_cluster.transfer.sender import KVSender

        self.spec = spec
        self.km = kv_model
        self.mp = kv_model.make(spec.kv_cache_dtype, spec.page_size, spec.num_pages, spec.model, spec.load_format,
                                spec.seed, spec.device)
        self.alloc = PageAllocator(spec.num_pages)
        cfg = TransferConfig(kv_transfer_timeout=spec.kv_transfer_timeout, heartbeat_interval=spec.heartbeat_interval,
                             abort_quarantine=spec.abort_quarantine, ucx_tls=spec.ucx_tls)
        self.registry = CollectorRegistry()
        self.agent = TransferAgent(self.mp.pool, self.mp.lm.identity, spec.role, cfg, spec.speculative)
        metrics = TransferMetrics(self.registry)
        self.sender = KVSender(self.agent, metrics) if spec.role == "prefill" else None
        self.receiver = KVReceiver(self.agent, metrics) if spec.role == "decode" else None
        self.directory = PeerDirectory()
        self.jobs: dict[str, dict] = {}
        self.events: list[dict] = []
        self.url = self._serve(spec.port)

    def _serve(self, port: int) -> str:
        import uvicorn
        from fastapi import FastAPI

        from pd_cluster.transfer.http import make_router

        app = FastAPI()
        app.include_router(make_router(self.agent.info))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def hello(self) -> dict:
        return {"url": self.url, "agent": self.agent.name, "incarnation": self.agent.incarnation,
                "pid": os.getpid(), "ucx": self.agent.ucx, "mem_type": self.agent.mem_type}

    # ---- the step loop ---------------------------------------------------------------------------------------
    def step(self) -> None:
        for tid, job in list(self.jobs.items()):
            if job["auto"] and job["pos"] < job["n"]:
                self.cmd_chunk(tid)
        if self.sender is not None:
            ev = self.sender.poll()
            for d in ev.completed:
                self._end_job(d.transfer_id)
                self.events.append({"kind": "completed", "tid": d.transfer_id, "num_pushes": d.num_pushes,
                                    "nbytes": d.nbytes, "t": time.monotonic()})
            for f in ev.failed:
                self._end_job(f.transfer_id)
                self.events.append(_failed(f))
        if self.receiver is not None:
            ev = self.receiver.poll()
            for d in ev.completed:
                self.events.append({"kind": "completed", "tid": d.transfer_id, "pages": list(d.pages),
                                    "meta": d.meta, "nbytes": d.nbytes, "t": time.monotonic(),
                                    "pushes": [(p.index, p.page_start, p.num_pages, p.nbytes, p.total)
                                               for p in d.pushes]})
            for f in ev.failed:
                self.events.append(_failed(f))
            for r in ev.released:
                self.alloc.free(r.pages)
                self.events.append({"kind": "released", "tid": r.transfer_id, "why": r.why, "t": time.monotonic()})

    def busy(self) -> bool:
        """Whether a transfer is in progress (the loop then polls without sleeping long)."""
        return bool(self.jobs) or any(e is not None and e.has_work for e in (self.sender, self.receiver))

    def _end_job(self, tid: str) -> None:
        job = self.jobs.pop(tid, None)
        if job is not None:
            self.alloc.free(job["pages"])

    # ---- commands --------------------------------------------------------------------------------------------
    def cmd_connect(self, url: str, expected: str | None = None) -> dict:
        from pd_cluster.transfer.http import apply

        r = self.directory.resolve(url, expected)
        apply(self.agent, r)
        return {"agent": r.info.agent_name, "fetched": r.fetched, "superseded": list(r.superseded),
                "restarts_seen": self.directory.num_restarts_seen}

    def cmd_invalidate(self, url: str) -> None:
        self.directory.invalidate(url)

    def cmd_connected(self, agent: str) -> bool:
        return self.agent.is_connected(agent)

    def cmd_expect(self, request_id: str, num_tokens: int, prefill_agent: str, skip_pages: int = 0,
                   first_page: int = 0) -> dict:
        """Reserve pages for the prompt's pages from `first_page` on (a delta ticket when > 0) and make the ticket."""
        hole = self.alloc.allocate(skip_pages) if skip_pages else []
        pages = self.alloc.allocate(self.km.pages_for(num_tokens, self.spec.page_size) - first_page)
        if hole:
            self.alloc.free(hole)  # leaves the request's pages away from page 1
        try:
            return self.receiver.expect(request_id, pages, num_tokens, prefill_agent, first_page).to_dict()
        except Exception:
            self.alloc.free(pages)
            raise

    def cmd_progress(self, tid: str) -> list[tuple]:
        self.step()
        return [(p.index, p.page_start, p.num_pages, p.nbytes, p.total) for p in self.receiver.progress(tid)]

    def cmd_withdraw(self, tid: str) -> None:
        self.alloc.free(self.receiver.withdraw(tid))

    def cmd_start(self, ticket: dict, ids: list[int] | None, chunk: int, auto: bool = True,
                  decode_url: str | None = None) -> list[int]:
        """Accept a ticket and prefill `ids` in chunks; ``ids=None`` skips the model and pushes
        pages of seeded random bytes instead (for transfers larger than the model can prefill).

        With `decode_url`, first make sure the ticket's decode agent is the one loaded, as a prefill
        worker does: the directory fetches that worker's info again when the ticket names an
        incarnation it does not hold, and the stale one is dropped."""
        import torch

        from pd_cluster.transfer.http import apply
        from pd_cluster.transfer.ticket import KVTicket

        t = KVTicket.from_dict(ticket)
        if decode_url is not None and not self.agent.is_connected(t.decode_agent):
            apply(self.agent, self.directory.resolve(decode_url, t.decode_agent))
        pages = self.alloc.allocate(self.km.pages_for(t.num_tokens, self.spec.page_size))
        try:
            if ids is None:
                gen = torch.Generator().manual_seed(len(pages))
                view = self.mp.pool.kv.view(torch.uint8)
                view[pages] = torch.randint(0, 256, view[pages].shape, dtype=torch.uint8,
                                            generator=gen).to(view.device)
            self.sender.add_request(t)
        except Exception:
            self.alloc.free(pages)
            raise
        self.jobs[t.transfer_id] = {"ids": ids, "n": t.num_tokens, "pages": pages, "pos": 0, "chunk": chunk,
                                    "auto": auto, "sent": t.first_page, "pushes": []}
        return pages

    def cmd_chunk(self, tid: str) -> dict:
        job = self.jobs[tid]
        lo = job["pos"]
        hi = min(lo + job["chunk"], job["n"])
        tok = self.km.prefill_chunk(self.mp, job["ids"], job["pages"], lo, hi) if job["ids"] is not None else 0
        job["pos"] = hi
        meta = {"first_token_id": tok} if hi == job["n"] else None
        ready = None
        if self.mp.device.type == "cuda":  # post the push once the chunk's kernels have written the pages
            import torch

            ready = torch.cuda.Event()
            ready.record()
        t0 = time.monotonic()
        n = self.sender.push(tid, job["pages"], hi, meta=meta, ready_event=ready)
        pushed = job["pages"][job["sent"]:job["sent"] + n]
        info = {"lo": lo, "hi": hi, "num_pages": n, "page_start": job["sent"], "t_push": t0,
                "hashes": self.km.page_hashes(self.mp.pool, pushed) if n and job["ids"] is not None else []}
        job["sent"] += n
        job["pushes"].append(info)
        return info

    def cmd_abort(self, tid: str) -> bool:
        return (self.sender or self.receiver).abort(tid)

    def cmd_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def cmd_state(self) -> dict:
        s = {"free": self.alloc.num_free, "num_pages": self.spec.num_pages, "jobs": len(self.jobs),
             "restarts_seen": self.directory.num_restarts_seen, "fetches": self.directory.num_fetches}
        if self.sender is not None:
            s["inflight"] = self.sender.num_inflight
        if self.receiver is not None:
            s["waiting"], s["quarantined"] = self.receiver.num_waiting, self.receiver.num_quarantined
        return s

    def cmd_page_hashes(self, pages: list[int]) -> list[str]:
        return self.km.page_hashes(self.mp.pool, pages)

    def cmd_pool_hash(self) -> str:
        return self.km.pool_hash(self.mp.pool)

    def cmd_generate(self, pages: list[int], num_prompt_tokens: int, first_token: int, n: int) -> list[int]:
        extra = self.alloc.allocate(max(0, self.km.pages_for(num_prompt_tokens + n, self.spec.page_size) - len(pages)))
        try:
            return self.km.greedy(self.mp, list(pages) + extra, num_prompt_tokens, first_token, n)
        finally:
            self.alloc.free(extra)

    def cmd_free(self, pages: list[int]) -> None:
        self.alloc.free(pages)

    def cmd_metrics(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def _failed(f) -> dict:
    e = f.error
    return {"kind": "failed", "tid": f.transfer_id, "type": type(e).__name__, "reason": e.reason,
            "side": getattr(e, "side", None), "message": str(e), "t": time.monotonic()}


def _describe(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "reason": getattr(e, "reason", None),
            "fields": getattr(e, "fields", None), "trace": traceback.format_exc(limit=5)}


def child_main(conn, spec_dicts: list[dict]) -> None:
    try:
        workers = []
        for d in spec_dicts:
            spec = PeerSpec(**d)
            os.environ.update(spec.env)
            workers.append(_Worker(spec))
    except BaseException as e:  # report start-up failures to the parent instead of dying silently
        conn.send(("err", _describe(e)))
        return
    conn.send(("ok", [w.hello() for w in workers]))
    while True:
        busy = any(w.busy() for w in workers)
        if conn.poll(0.0005 if busy else 0.005):
            slot, cmd, args = conn.recv()
            if cmd == "exit":
                for w in workers:
                    w.agent.close()
                conn.send(("ok", None))
                return
            try:
                result = ("ok", getattr(workers[slot], "cmd_" + cmd)(*args))
            except Exception as e:
                result = ("err", _describe(e))
            conn.send(result)
        for w in workers:
            w.step()


# ---- the parent's handles ----------------------------------------------------------------------------------
class PeerProcess:
    """One spawned process hosting a `_Worker` per spec (each with its own pool, agent and HTTP server).

    The process starts at once; `ready` waits for it. Use `peers` after `ready`.
    """

    def __init__(self, specs: list[PeerSpec]) -> None:
        self.specs = list(specs)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child, [asdict(s) for s in specs]), daemon=True)
        self.proc.start()
        child.close()
        self.peers: list[Peer] = []

    def ready(self, timeout: float = START_TIMEOUT) -> list[Peer]:
        try:
            hellos = self._recv(timeout)
        except BaseException:
            self.kill()
            raise
        self.peers = [Peer(self, i, spec, h) for i, (spec, h) in enumerate(zip(self.specs, hellos))]
        return self.peers

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer process {self.proc.pid} did not answer in {timeout} s")
        status, value = self.conn.recv()
        if status == "err":
            raise PeerCallError(value)
        return value

    def call(self, slot: int, cmd: str, args: tuple, timeout: float):
        self.conn.send((slot, cmd, args))
        return self._recv(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.signal(signal.SIGCONT)
                self.call(0, "exit", (), 10)
            except Exception:
                pass
            self.proc.join(5)
        self.kill()


class Peer:
    """The parent's handle on one worker of a `PeerProcess`."""

    def __init__(self, process: PeerProcess, slot: int, spec: PeerSpec, hello: dict) -> None:
        self.process, self.slot, self.spec, self.hello = process, slot, spec, hello
        self.url, self.agent, self.incarnation = hello["url"], hello["agent"], hello["incarnation"]

    def call(self, cmd: str, *args, timeout: float = CALL_TIMEOUT):
        return self.process.call(self.slot, cmd, args, timeout)

    def wait_events(self, until, timeout: float) -> list[dict]:
        """Collect events until ``until(events)`` holds; raises TimeoutError after `timeout` seconds."""
        events: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            events += self.call("events")
            if until(events):
                return events
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.role} peer: condition not met in {timeout} s; events: {events}")
            time.sleep(0.005)

    def signal(self, sig: int) -> None:
        self.process.signal(sig)

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        self.process.close()
