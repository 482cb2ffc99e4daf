"""The two worker processes of `pd_cluster.bench.scripts.transfer_throughput`: a prefill side and a
decode side, each holding real engine KV pools with a `TransferAgent`, driven over a pipe by
the parent (`transfer_throughput.Pair`)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pd_cluster.transfer.ucx_log import put_protocols

PAGE_SIZES = (16, 64)
PAGE_COUNTS = (16, 256, 4096)
HANDOVER_TOKENS, HANDOVER_CHUNK = 2000, 256
DATA = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True)
class Options:
    ucx_tls: str | None
    progress_thread: bool
    hugepages: bool
    reps_small: int
    reps_large: int
    handover_runs: int


# ---- the worker processes -----------------------------------------------------------------------------------
class _Side:
    """One pool per page size, each with its own agent, sender or receiver."""

    def __init__(self, role: str, opts: Options, num_pages: int) -> None:
        import torch
        from prometheus_client import CollectorRegistry

        from pd_cluster.engine.assets import DEFAULT_MODEL
        from pd_cluster.engine.kv.allocator import PageAllocator
        from pd_cluster.engine.kv.pool import KVLayout, KVPool
        from pd_cluster.engine.model.loader import load_model
        from pd_cluster.transfer.agent import TransferAgent
        from pd_cluster.transfer.config import TransferConfig
        from pd_cluster.transfer.metrics import TransferMetrics
        from pd_cluster.transfer.receiver import KVReceiver
        from pd_cluster.transfer.sender import KVSender

        torch.set_num_threads(1)
        self.hugepages = opts.hugepages
        self.lm = load_model(DEFAULT_MODEL)
        a = self.lm.arch
        cfg = TransferConfig(kv_transfer_timeout=60.0, ucx_tls=opts.ucx_tls,
                             enable_progress_thread=opts.progress_thread, hugepages=opts.hugepages)
        self.pools, self.allocs, self.agents, self.ends, self.registries = {}, {}, {}, {}, {}
        for ps in PAGE_SIZES:
            layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, ps, "fp8_e4m3",
                              tuple(self.lm.k_scales), tuple(self.lm.v_scales))
            pool = KVPool(layout, num_pages, "cpu", torch.float32)
            if role == "prefill":  # real-looking bytes: random FP8 codes in every page
                pool.kv.copy_(torch.randint(0, 120, pool.kv.shape, dtype=torch.uint8))
            agent = TransferAgent(pool, self.lm.identity, role, cfg)
            self.registries[ps] = CollectorRegistry()
            metrics = TransferMetrics(self.registries[ps])
            self.pools[ps], self.allocs[ps], self.agents[ps] = pool, PageAllocator(num_pages), agent
            self.ends[ps] = KVSender(agent, metrics) if role == "prefill" else KVReceiver(agent, metrics)

    def infos(self) -> dict:
        return {ps: ag.info.to_dict() for ps, ag in self.agents.items()}

    def connect(self, infos: dict) -> None:
        from pd_cluster.transfer.layout import AgentInfo

        for ps, d in infos.items():
            self.agents[ps].connect(AgentInfo.from_dict(d))


def decode_main(conn, opts: Options) -> None:
    side = _Side("decode", opts, 2 * max(PAGE_COUNTS) + 64)
    conn.send(side.infos())
    side.connect(conn.recv())
    interval = 0.002
    while True:
        # Decode waits on the pipe between polls rather than spin: this host has 2 cores, and a
        # spinning decode takes CPU from the copy being measured. The throughput phase polls every
        # 2 ms (the copy is timed on the prefill side); the handover phase every 0.2 ms, which bounds
        # the poll delay included in the handover time.
        if conn.poll(interval):
            cmd, *args = conn.recv()
            if cmd == "exit":
                return
            if cmd == "interval":
                interval = args[0]
            if cmd == "expect":  # (page_size, num_pages, num_tokens, fragmented, prefill agent)
                ps, n, tokens, frag, prefill = args
                pages = side.allocs[ps].allocate(2 * n if frag else n)
                keep, spare = (pages[::2], pages[1::2]) if frag else (pages, [])
                side.allocs[ps].free(spare)
                conn.send(side.ends[ps].expect(f"bench-{time.monotonic_ns()}", keep, tokens, prefill).to_dict())
        for ps, rcv in side.ends.items():
            ev = rcv.poll()
            for d in ev.completed:  # tell the parent at once: (transfer id, CLOCK_MONOTONIC of completion)
                conn.send(("done", d.transfer_id, time.monotonic()))
                side.allocs[ps].free(d.pages)
            for f in ev.failed:
                raise RuntimeError(f"transfer failed on decode: {f.error}")


def _capture_output() -> tuple[tuple[int, int], str]:
    """Send this process's stdout and stderr (where UCX prints its protocol tables) to a temporary file."""
    fd, path = tempfile.mkstemp(prefix="ucx-proto-")
    saved = (os.dup(1), os.dup(2))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved, path


def _restore_output(saved: tuple[int, int]) -> None:
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)


def prefill_main(conn, opts: Options) -> None:
    import torch

    os.environ["UCX_PROTO_INFO"] = "y"
    saved, proto_path = _capture_output()
    try:
        side = _Side("prefill", opts, max(PAGE_COUNTS) + 64)
        conn.send(side.infos())
        side.connect(conn.recv())
        tok = None
        while True:
            if not conn.poll(0.0002 if any(e.has_work for e in side.ends.values()) else None):
                for e in side.ends.values():  # a worker keeps polling until its last messages are acknowledged
                    e.poll()
                continue
            cmd, *args = conn.recv()
            if cmd == "exit":
                return
            if cmd == "ucx":
                conn.send(put_protocols(Path(proto_path).read_text(errors="replace")))
            elif cmd == "push":  # (ticket, reps index) -> (seconds, memcpy seconds, descriptors, bytes)
                conn.send(_timed_push(side, *args))
            elif cmd == "handover":
                if tok is None:
                    from transformers import AutoTokenizer

                    from pd_cluster.engine.assets import DEFAULT_MODEL
                    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
                conn.send(_handover(side, args[0], _prompt(tok, HANDOVER_TOKENS), torch))
    except BaseException:
        _restore_output(saved)  # show what UCX and NIXL said before the failure
        print(Path(proto_path).read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        _restore_output(saved)
        os.unlink(proto_path)


def _timed_push(side: _Side, ticket_dict: dict, copy_first: bool) -> tuple[float, float, int, int]:
    """One push of a ticket's pages and one memcpy of the same bytes; the order alternates across calls so
    that neither always finds the source in the cache."""
    from pd_cluster.transfer.descriptors import page_runs
    from pd_cluster.transfer.ticket import KVTicket

    t = KVTicket.from_dict(ticket_dict)
    ps, sender, alloc = t.page_size, side.ends[t.page_size], side.allocs[t.page_size]
    nbytes = t.num_pages * side.pools[ps].layout.page_nbytes
    src, dst = side.pools[ps].kv.view(-1)[:nbytes], _scratch(nbytes, side.hugepages)

    def copy() -> float:
        c0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - c0

    def write_seconds() -> float:  # the sender's own per-push latency metric: post to WRITE complete
        return side.registries[ps].get_sample_value("pd:kv_transfer_latency_seconds_sum") or 0.0

    mc = copy() if copy_first else 0.0
    pages = alloc.allocate(t.num_pages)
    sender.add_request(t)
    w0 = write_seconds()
    t0 = time.perf_counter()
    sender.push(t.transfer_id, pages, t.num_tokens)
    ev = _until_done(sender)
    dt = time.perf_counter() - t0
    if ev.failed:
        raise RuntimeError(f"push failed: {ev.failed[0].error}")
    alloc.free(pages)
    if not copy_first:
        mc = copy()
    return dt, mc, page_runs(pages, t.dst_pages).num_runs, nbytes, write_seconds() - w0


def _until_done(sender, limit_s: float = 60.0):
    """Poll until the one transfer in flight ends (bounded)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ev = sender.poll()
        if ev.completed or ev.failed:
            return ev
    raise TimeoutError(f"a transfer did not end in {limit_s} s ({sender.num_inflight} in flight)")


_SCRATCH: dict[int, object] = {}


def _scratch(nbytes: int, huge: bool):
    """The memcpy destination: touched (no page faults in the timed copy), in the same kind of pages as the pools."""
    import torch

    from pd_cluster.transfer import hugepages

    if nbytes not in _SCRATCH:
        _SCRATCH[nbytes] = torch.ones(nbytes, dtype=torch.uint8)
        if huge:
            hugepages.advise(_SCRATCH[nbytes])
    return _SCRATCH[nbytes]


def _prompt(tok, n: int) -> list[int]:
    ids: list[int] = []
    for row in json.loads((DATA / "sharegpt_300.json").read_text()):
        ids += tok(row["conversations"][0]["value"]).input_ids
        if len(ids) >= n:
            return ids[:n]
    raise ValueError("not enough ShareGPT text")


def _handover(side: _Side, ticket_dict: dict, ids: list[int], torch) -> dict:
    import numpy as np

    from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
    from pd_cluster.engine.batch import build_forward_batch
    from pd_cluster.transfer.ticket import KVTicket

    t = KVTicket.from_dict(ticket_dict)
    ps, sender, alloc = t.page_size, side.ends[t.page_size], side.allocs[t.page_size]
    a = side.lm.arch
    backend = TorchAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5)
    pages = alloc.allocate(t.num_pages)
    sender.add_request(t)
    pushes, compute = 0, 0.0
    last_forward_end = None
    with torch.inference_mode():
        for lo in range(0, len(ids), HANDOVER_CHUNK):
            hi = min(lo + HANDOVER_CHUNK, len(ids))
            c0 = time.perf_counter()
            b = build_forward_batch([np.asarray(ids[lo:hi])], [lo], [pages], [np.array([hi - lo - 1])], 0, ps,
                                    torch.device("cpu"))
            first = int(side.lm.model(b, side.pools[ps], backend)[-1].argmax())
            compute += time.perf_counter() - c0
            if hi == len(ids):
                last_forward_end = time.monotonic()
            meta = {"first_token_id": first} if hi == len(ids) else None
            pushes += sender.push(t.transfer_id, pages, hi, meta=meta) > 0
            ev = sender.poll()  # a worker polls every step; the last poll may already see the end
    if not (ev.completed or ev.failed):
        ev = _until_done(sender)
    alloc.free(pages)
    if ev.failed:
        raise RuntimeError(f"handover failed: {ev.failed[0].error}")
    return {"last_forward_end": last_forward_end, "pushes": pushes, "compute_s": compute}
