"""The NIXL step of the GPU first contact (`first_contact`): VRAM-to-VRAM WRITEs with the descriptors a real
transfer uses once the pools are loaded, under UCX settings for ``cuda_ipc``.

1. **Page runs of loaded pools** (`first_contact_pageruns.simulate`): the engine's page managers replay the
   shipped Mooncake trace on a prefill and a decode pool of `NUM_PAGES` pages of 64 tokens; probe prompts of
   2k and 8k tokens then join the stream. Recorded: descriptors (runs of pages consecutive on both sides) per
   transfer over the whole replay, and each probe's descriptor list.
2. **NIXL WRITEs of those lists** between two processes on the one device, each holding a pool of `NUM_PAGES`
   Llama-3.1-8B pages (FP8 KV, 64 tokens, all 32 layers: 4 MiB a page) registered as the workers register
   theirs, with the agent settings the workers use (`transfer.config.TransferConfig`): for each probe, its real
   descriptor list, the same pages as one descriptor per page (no merging), and the same bytes as one
   descriptor (merging at its best). Time: from the post (``initialize_xfer``) to DONE, as
   ``pd:kv_transfer_latency_seconds`` counts it; rate: bytes once over time, against half the measured copy
   rate (a copy reads and writes). Every written byte is checked (sums over the written ranges on both sides).
3. **UCX settings** (`SETTINGS`): the workers' defaults, then each setting alone, each in a fresh pair of
   processes (UCX reads its environment when the agent starts).

Target: the 8k probe's real descriptors with the workers' defaults >= 80% of copy. A miss has no kernel table
(the copy runs inside UCX's ``cuda_ipc``); the per-descriptor cost and the settings table stand for it.
``--dry-run``: DRAM-to-DRAM pools of 4 KiB pages on CPU, a short replay; numbers mean nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

from pd_cluster.bench.scripts.first_contact_pageruns import simulate
from pd_cluster.bench.scripts.first_contact_part import finish, load_ceilings, start_part
from pd_cluster.bench.scripts.gpu_common import Row, Section

NUM_PAGES = 4096            # 16 GiB a side at 4 MiB a page
PAGE_NBYTES = 64 * 32 * 2 * 8 * 128  # Llama-3.1-8B, FP8 KV, 64 tokens x 32 layers x K/V x 8 heads x 128
SETTINGS: tuple[tuple[str, dict, dict], ...] = (  # (name, UCX environment, agent-config overrides)
    ("worker defaults", {}, {}),
    ("UCX_PROTO_ENABLE=n (UCX's v1 protocols)", {"UCX_PROTO_ENABLE": "n"}, {}),
    ("UCX_CUDA_IPC_MAX_STREAMS=1", {"UCX_CUDA_IPC_MAX_STREAMS": "1"}, {}),
    ("NIXL UCX backend num_threads=4", {}, {"num_threads": 4}),
)
ITERS = 5


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray, dev: int) -> np.ndarray:
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + offsets.astype(np.uint64)
    out[:, 1] = lengths.astype(np.uint64)
    out[:, 2] = dev
    return out


def _agent(name: str, overrides: dict):
    from nixl._api import nixl_agent, nixl_agent_config

    from pd_cluster.transfer import ucx_env
    from pd_cluster.transfer.config import TransferConfig
    c = TransferConfig()
    ucx_env.apply(c)  # the workers' UCX environment (ucx_env's module doc)
    kwargs = dict(enable_prog_thread=c.enable_progress_thread, backends=[c.backend], num_threads=c.num_threads)
    try:
        from nixl._api import nixl_thread_sync_t
        kwargs["sync_mode"] = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    except ImportError:
        pass
    return nixl_agent(name, nixl_agent_config(**{**kwargs, **overrides}))


def ucx_version() -> str:
    """The version of the UCX library loaded in this process (from ``ucp_get_version_string``)."""
    import ctypes
    with open("/proc/self/maps") as fh:
        paths = {line.split()[-1] for line in fh if "libucp" in line and line.split()[-1].startswith("/")}
    for path in sorted(paths):
        fn = ctypes.CDLL(path).ucp_get_version_string
        fn.restype = ctypes.c_char_p
        return f"{fn().decode()} ({path})"
    return "libucp not loaded"


def _pool(nbytes: int, use_cuda: bool, fill: bool):
    import torch
    dev = "cuda:0" if use_cuda else "cpu"
    if not fill:
        return torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    return torch.randint(1, 255, (nbytes,), dtype=torch.uint8, device=dev)


def _sums(buf, offsets, lengths) -> int:
    import torch
    return sum(int(buf[int(o):int(o) + int(n)].sum(dtype=torch.int64)) for o, n in zip(offsets, lengths))


def _wait(conn, agent):
    """Receive from `conn`, progressing `agent` meanwhile (the workers run NIXL without a progress thread, so a
    side that only waits would never answer UCX's connection set-up)."""
    while not conn.poll(0.002):
        agent.get_new_notifs()
    return conn.recv()


def _run(role: str, conn, *args) -> None:
    """A spawned process's body (`_target` or `_initiator`); an exception goes back through the pipe as
    ``("error", text)``."""
    try:
        (_target if role == "target" else _initiator)(conn, *args)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which records it
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        conn.send(("error", f"{type(e).__name__}: {e} (at {where.name}: {where.line})"))


def _target(conn, nbytes: int, use_cuda: bool, env: dict, overrides: dict) -> None:
    import os
    os.environ.update(env)
    buf = _pool(nbytes, use_cuda, fill=False)
    agent = _agent("fc-target", overrides)
    agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    agent.add_remote_agent(_wait(conn, agent))
    while True:
        msg = _wait(conn, agent)
        if msg is None:
            break
        conn.send(_sums(buf, *msg))  # the bytes the last list wrote, summed
    conn.close()


def _initiator(conn, nbytes: int, lists: list, use_cuda: bool, env: dict, overrides: dict) -> None:
    import os
    os.environ.update(env)
    mem, dev = ("VRAM", 0) if use_cuda else ("DRAM", 0)
    buf = _pool(nbytes, use_cuda, fill=True)
    agent = _agent("fc-initiator", overrides)
    agent.register_memory([buf])
    meta, peer_base = _wait(conn, agent)
    name = agent.add_remote_agent(meta)
    name = name.decode() if isinstance(name, bytes) else name
    conn.send(agent.get_agent_metadata())
    results = {"ucx": ucx_version()}
    for key, (src_off, dst_off, lengths) in lists:
        local = agent.get_xfer_descs(_descs(buf.data_ptr(), src_off, lengths, dev), mem)
        remote = agent.get_xfer_descs(_descs(peer_base, dst_off, lengths, dev), mem)
        post, xfer = [], []
        for i in range(ITERS + 2):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", local, remote, name, b"fc")
            t1 = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            t2 = time.perf_counter()
            agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL transfer {key} failed")
            if i >= 2:  # the first two connect and warm up
                post.append(t2 - t0)
                xfer.append(t2 - t1)
        conn.send((dst_off, lengths))
        ok = _wait(conn, agent) == _sums(buf, src_off, lengths)
        results[key] = (statistics.median(post), statistics.median(xfer), ok)
    conn.send(None)
    conn.send(results)
    conn.close()


def measure(lists: list, nbytes: int, use_cuda: bool, env: dict, overrides: dict, timeout_s: float) -> dict:
    """Median seconds (post to done, transfer to done) and data check of each ``(key, (src offsets, dst offsets,
    lengths))`` in `lists`, in a fresh pair of processes with `env` and agent `overrides`; also ``"ucx"``."""
    ctx = mp.get_context("spawn")
    a_t, b_t = ctx.Pipe()
    a_i, b_i = ctx.Pipe()
    procs = [ctx.Process(target=_run, args=("target", b_t, nbytes, use_cuda, env, overrides), daemon=True),
             ctx.Process(target=_run, args=("initiator", b_i, nbytes, lists, use_cuda, env, overrides),
                         daemon=True)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        def recv(conn):
            while not conn.poll(0.05):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL benchmark process did not answer within {timeout_s:.0f} s")
                dead = [p.exitcode for p in procs if p.exitcode is not None]
                if dead and not conn.poll(0.2):
                    raise RuntimeError(f"a NIXL benchmark process exited (codes {dead})")
            msg = conn.recv()
            if isinstance(msg, tuple) and len(msg) == 2 and isinstance(msg[0], str) and msg[0] == "error":
                raise RuntimeError(f"in the NIXL benchmark process: {msg[1]}")
            return msg

        a_i.send(recv(a_t))          # target metadata -> initiator
        a_t.send(recv(a_i))          # initiator metadata -> target
        while True:                  # each list: the written ranges -> target, its sum -> initiator
            msg = recv(a_i)
            a_t.send(msg)
            if msg is None:
                break
            a_i.send(recv(a_t))
        return recv(a_i)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _lists(hist, page_nbytes: int) -> tuple[list, dict]:
    """The descriptor lists to time per probe length (first probe of each): real runs, one per page, one in all."""
    from pd_cluster.transfer.descriptors import page_runs

    lists, meta = [], {}
    for t in hist.probes:
        if f"{t.prompt_tokens} real" in meta:
            continue
        src = np.concatenate([np.asarray(s, dtype=np.int64) for s, _ in t.pushes])
        dst = np.concatenate([np.asarray(d, dtype=np.int64) for _, d in t.pushes])
        runs = [page_runs(s, d) for s, d in t.pushes]
        starts_s = np.concatenate([r.src_start for r in runs])
        starts_d = np.concatenate([r.dst_start for r in runs])
        length = np.concatenate([r.length for r in runs])
        n = len(src)
        for kind, entry in (("real", (starts_s * page_nbytes, starts_d * page_nbytes, length * page_nbytes)),
                            ("per page", (src * page_nbytes, dst * page_nbytes, np.full(n, page_nbytes))),
                            ("one descriptor", (np.zeros(1, np.int64), np.zeros(1, np.int64),
                                                np.array([n * page_nbytes])))):
            key = f"{t.prompt_tokens} {kind}"
            lists.append((key, entry))
            meta[key] = (len(entry[2]), len(t.pushes), n * page_nbytes)
    return lists, meta


def runs_section(hist, num_pages: int) -> Section:
    r = np.asarray(hist.runs_per_transfer)
    p = np.asarray(hist.pages_per_transfer)
    sec = Section(f"Page runs of loaded pools ({num_pages} pages of 64 tokens a side, Mooncake conversation trace)",
                  ["transfers", "descriptors per transfer p50 / p90 / max", "pages per descriptor (all)",
                   "decode pool use at the probes"])
    use = ", ".join(f"{u:.2f}" for u in hist.decode_use)
    sec.rows.append(Row([len(r), f"{np.median(r):.0f} / {np.percentile(r, 90):.0f} / {r.max()}",
                         float(p.sum() / max(r.sum(), 1)), use]))
    for t in hist.probes:
        sec.notes.append(f"probe of {t.prompt_tokens} tokens: {len(t.pushes)} push(es), {t.num_pages} pages, "
                         f"{t.num_runs} descriptors")
    sec.notes.append(f"{hist.finished} requests finished before the end; descriptors = runs of pages consecutive on "
                     "both sides (transfer/descriptors.py), summed over a transfer's pushes.")
    return sec


def main(argv: list[str] | None = None) -> int:
    args, part = start_part(argv, "nixl", __doc__)
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        part.skip("NIXL WRITEs", f"NIXL is not installed here ({e}); see docs/gpu.md for carrying its wheels")
        return finish(part)
    use_cuda = args.device.type == "cuda"
    num_pages, page_nbytes = (NUM_PAGES, PAGE_NBYTES) if not args.dry_run else (512, 4096)
    ceil = load_ceilings(args.work, args.device, args.dry_run)
    hist = None
    with part.guard("page runs of loaded pools"):
        sim = dict(num_requests=60, warmup=20, probes_each=1, max_output=32) if args.dry_run else {}
        hist = simulate(num_pages, **sim)
        part.section(runs_section(hist, num_pages))
    if hist is None or not hist.probes:
        return finish(part)
    lists, meta = _lists(hist, page_nbytes)
    mem = "VRAM" if use_cuda else "DRAM"
    sec = Section(f"NIXL {mem}-to-{mem} WRITE of a probe's pages between two processes on one device",
                  ["setting", "transfer", "descriptors", "MiB", "post to done (ms)", "transfer to done (ms)",
                   "GB/s (bytes once)", "% of copy", "data ok"])
    ref = ceil.copy_gbps / 2
    default_pct, versions = None, set()
    # a dry run takes the defaults and one setting of both kinds (environment, agent config) together; UCX's v1
    # protocols refuse DRAM over TCP
    settings = SETTINGS if not args.dry_run else (SETTINGS[0], ("dry run: environment + agent config",
                                                                 {"UCX_CUDA_IPC_MAX_STREAMS": "1"}, {"num_threads": 2}))
    for i, (name, env, overrides) in enumerate(settings):
        share = max(10.0, part.left_s() / (len(settings) - i))
        with part.guard(f"NIXL WRITEs, {name}"):
            res = measure(lists, (num_pages + 1) * page_nbytes, use_cuda, env, overrides, share)  # + null page 0
            versions.add(res.pop("ucx"))
            for key, (post, xfer, ok) in res.items():
                ndesc, npush, nbytes = meta[key]
                gbps = nbytes / post / 1e9
                sec.rows.append(Row([name, key + (f" ({npush} pushes)" if npush > 1 else ""), ndesc,
                                     nbytes / 2**20, post * 1e3, xfer * 1e3, gbps, 100 * gbps / ref, ok]))
                if not ok:
                    part.error(f"NIXL {name} {key}", ValueError("the bytes written differ from the source"))
                if i == 0 and key.endswith(" real"):
                    default_pct = (100 * gbps / ref, key)
    sec.notes.append(f"copy ceiling {ceil.copy_gbps:.0f} GB/s counts read + write, so bytes once are compared with "
                     f"half of it; {ITERS} timed transfers each after 2 warm-ups, medians; UCX {', '.join(versions)}")
    part.section(sec)
    part.info("ucx", sorted(versions))
    if default_pct is not None:
        part.target("nixl", default_pct[0], f"{default_pct[1].split()[0]}-token probe, worker defaults",
                    note="no kernel table: the copy runs inside UCX cuda_ipc")
    return finish(part)


if __name__ == "__main__":
    sys.exit(main())
