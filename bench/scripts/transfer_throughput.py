"""KV transfer benchmark: NIXL push throughput against memcpy, descriptors per request, handover time.

Two spawned processes, a prefill worker and a decode worker, each hold real
engine KV pools (stories260K's layout, FP8, page sizes 16 and 64) with a
`TransferAgent`, and move pages through the library itself (`KVReceiver.expect`
-> ticket -> `KVSender.add_request` / `push` / `poll`). Measured in one run:

1. Throughput of one request's pages (16, 256, 4,096 pages; page size 16 and 64):
   bytes of the push over the time from the `push` call until `poll` reports the
   push complete (the data is then in decode's pages). In the same process and
   interleaved with it, a single-thread ``torch`` copy of the same bytes between
   two warm buffers gives the memcpy reference. A "fragmented" row gives decode
   every other page, so each page is its own descriptor.
2. Handover: a 2,000-token prompt (real ShareGPT text) prefilled by the real
   model in chunks of 256, each chunk pushed as soon as it is computed; the time
   from the end of the last chunk's forward pass to decode's `poll` reporting
   the transfer complete (both clocks are the host's CLOCK_MONOTONIC). Decode
   polls every 0.2 ms here (every 2 ms during part 1, so that it does not take
   the CPU from the copy being timed on this 2-core host).
3. Which UCX transport carried the WRITEs (UCX's own protocol table, captured
   from the prefill process with ``UCX_PROTO_INFO=y``).

Run: ``python -m bench.scripts.transfer_throughput`` (add ``--ucx-tls tcp`` to
force TCP, ``--progress-thread`` to run NIXL's progress thread). Prints tables.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from transfer.ucx_env import put_protocols

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

        from engine.assets import DEFAULT_MODEL
        from engine.kv.allocator import PageAllocator
        from engine.kv.pool import KVLayout, KVPool
        from engine.model.loader import load_model
        from transfer.agent import TransferAgent
        from transfer.config import TransferConfig
        from transfer.metrics import TransferMetrics
        from transfer.receiver import KVReceiver
        from transfer.sender import KVSender

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
        from transfer.layout import AgentInfo

        for ps, d in infos.items():
            self.agents[ps].connect(AgentInfo.from_dict(d))


def _decode_main(conn, opts: Options) -> None:
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


def _prefill_main(conn, opts: Options) -> None:
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

                    from engine.assets import DEFAULT_MODEL
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
    from transfer.descriptors import page_runs
    from transfer.ticket import KVTicket

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

    from transfer import hugepages

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

    from engine.attention.torch_ref import TorchAttentionBackend
    from engine.batch import build_forward_batch
    from transfer.ticket import KVTicket

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


# ---- the parent ---------------------------------------------------------------------------------------------
class Pair:
    def __init__(self, opts: Options, timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self.d, d_child = ctx.Pipe()
        self.p, p_child = ctx.Pipe()
        self.dec = ctx.Process(target=_decode_main, args=(d_child, opts), daemon=True)
        self.pre = ctx.Process(target=_prefill_main, args=(p_child, opts), daemon=True)
        self.dec.start()
        self.pre.start()
        d_info, p_info = self._recv(self.d), self._recv(self.p)
        self.d.send(p_info)
        self.p.send(d_info)
        self.prefill_agents = {ps: i["agent_name"] for ps, i in p_info.items()}
        self.nbytes_per_page = {ps: i["layout"]["page_nbytes"] for ps, i in p_info.items()}

    def _recv(self, conn):
        if not conn.poll(self.timeout):
            raise TimeoutError("a benchmark worker did not answer")
        return conn.recv()

    def ask(self, conn, *msg):
        conn.send(msg)
        return self._recv(conn)

    def wait_done(self, tid: str) -> float:
        """Decode's completion time of `tid` (CLOCK_MONOTONIC), as decode reports it."""
        kind, done_tid, t = self._recv(self.d)
        if (kind, done_tid) != ("done", tid):
            raise RuntimeError(f"expected completion of {tid}, got {kind} {done_tid}")
        return t

    def close(self) -> None:
        for conn in (self.d, self.p):
            try:
                conn.send(("exit",))
            except OSError:
                pass
        for proc in (self.dec, self.pre):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def throughput(pair: Pair, opts: Options) -> list[dict]:
    rows = []
    cases = [(ps, n, False) for ps in PAGE_SIZES for n in PAGE_COUNTS] + [(16, 4096, True), (64, 256, True)]
    for ps, n, frag in cases:
        reps = opts.reps_small if n * pair.nbytes_per_page[ps] < (4 << 20) else opts.reps_large
        times, copies, writes, descs = [], [], [], 0
        for i in range(reps + 2):
            ticket = pair.ask(pair.d, "expect", ps, n, n * ps, frag, pair.prefill_agents[ps])
            dt, mc, descs, nbytes, wt = pair.ask(pair.p, "push", ticket, i % 2 == 1)
            pair.wait_done(ticket["transfer_id"])
            if i >= 2:  # the first two warm up (connection, first touch)
                times.append(dt)
                copies.append(mc)
                writes.append(wt)
        t, c, w = statistics.median(times), statistics.median(copies), statistics.median(writes)
        rows.append({"page_size": ps, "pages": n, "fragmented": frag, "bytes": nbytes, "descriptors": descs,
                     "reps": reps, "push_ms": t * 1e3, "write_ms": w * 1e3, "nixl_gbps": nbytes / w / 1e9,
                     "memcpy_gbps": nbytes / c / 1e9, "ratio": c / w,
                     "paired_ratio": statistics.median(ci / wi for wi, ci in zip(writes, copies)),
                     "push_ratio": c / t})
    return rows


def handover(pair: Pair, opts: Options) -> list[dict]:
    rows = []
    pair.d.send(("interval", 0.0002))
    for ps in PAGE_SIZES:
        lat, pushes, compute = [], 0, []
        n_pages = -(-HANDOVER_TOKENS // ps)
        for i in range(opts.handover_runs + 1):
            ticket = pair.ask(pair.d, "expect", ps, n_pages, HANDOVER_TOKENS, False, pair.prefill_agents[ps])
            r = pair.ask(pair.p, "handover", ticket)
            done = pair.wait_done(ticket["transfer_id"])
            if i >= 1:
                lat.append(done - r["last_forward_end"])
                compute.append(r["compute_s"])
                pushes = r["pushes"]
        lat.sort()
        rows.append({"page_size": ps, "pages": n_pages, "pushes": pushes, "runs": len(lat),
                     "p50_ms": statistics.median(lat) * 1e3, "p90_ms": lat[int(0.9 * (len(lat) - 1))] * 1e3,
                     "max_ms": lat[-1] * 1e3, "prefill_compute_ms": statistics.median(compute) * 1e3})
    return rows


def print_tables(tp: list[dict], ho: list[dict], ucx: list[str], opts: Options) -> None:
    print(f"# KV transfer: NIXL push between two processes vs single-thread memcpy "
          f"(UCX_TLS={opts.ucx_tls or os.environ.get('UCX_TLS') or 'default'}, "
          f"progress thread {'on' if opts.progress_thread else 'off'}, "
          f"pools in {'huge' if opts.hugepages else '4 KiB'} pages)\n")
    print("| page size | pages | layout on decode | bytes | descriptors | reps | push -> done ms | WRITE ms "
          "| WRITE GB/s | memcpy GB/s | WRITE / memcpy | paired (p50) | push -> done / memcpy |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in tp:
        size = f"{r['bytes'] / 2**20:.2f} MiB" if r["bytes"] >= 2**20 else f"{r['bytes'] / 2**10:.0f} KiB"
        print(f"| {r['page_size']} | {r['pages']} | {'every other page' if r['fragmented'] else 'consecutive'} "
              f"| {size} | {r['descriptors']} | {r['reps']} | {r['push_ms']:.3f} | {r['write_ms']:.3f} "
              f"| {r['nixl_gbps']:.2f} | {r['memcpy_gbps']:.2f} | {100 * r['ratio']:.0f}% "
              f"| {100 * r['paired_ratio']:.0f}% | {100 * r['push_ratio']:.0f}% |")
    print(f"\n# Handover: {HANDOVER_TOKENS}-token prompt, chunks of {HANDOVER_CHUNK}, end of the last forward pass "
          "-> decode poll sees completion\n")
    print("| page size | pages | pushes | runs | p50 ms | p90 ms | max ms | prefill compute ms (p50) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ho:
        print(f"| {r['page_size']} | {r['pages']} | {r['pushes']} | {r['runs']} | {r['p50_ms']:.3f} "
              f"| {r['p90_ms']:.3f} | {r['max_ms']:.3f} | {r['prefill_compute_ms']:.1f} |")
    print("\nUCX protocols for remote memory writes (prefill process, UCX_PROTO_INFO=y): "
          + ("; ".join(ucx) if ucx else "(none reported)"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for both workers (default: the environment's / UCX's)")
    ap.add_argument("--progress-thread", action="store_true", help="run NIXL's UCX progress thread")
    ap.add_argument("--no-hugepages", action="store_true", help="keep the pools in 4 KiB pages")
    ap.add_argument("--reps-small", type=int, default=60, help="repetitions of transfers under 4 MiB")
    ap.add_argument("--reps-large", type=int, default=30, help="repetitions of transfers of 4 MiB or more")
    ap.add_argument("--handover-runs", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the raw rows to this file")
    a = ap.parse_args(argv)
    opts = Options(a.ucx_tls, a.progress_thread, not a.no_hugepages, a.reps_small, a.reps_large, a.handover_runs)
    pair = Pair(opts)
    try:
        tp = throughput(pair, opts)
        ho = handover(pair, opts)
        ucx = pair.ask(pair.p, "ucx")
    finally:
        pair.close()
    print_tables(tp, ho, ucx, opts)
    if a.json:
        Path(a.json).write_text(json.dumps({"throughput": tp, "handover": ho, "ucx": ucx}, indent=1))


if __name__ == "__main__":
    main()
