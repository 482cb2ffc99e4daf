"""NIXL (UCX) VRAM-to-VRAM WRITE throughput between two processes on one GPU.

Two spawned processes each allocate a buffer on the GPU and register it with a
NIXL agent (UCX backend); they swap agent metadata and buffer addresses over a
pipe, then the initiator posts WRITEs of the whole buffer, cut into
descriptors of `desc_bytes` (a KV page run), and waits for each to finish.
Reported: bytes moved once per transfer over the median transfer time. On a
host without CUDA the same code runs DRAM-to-DRAM (`--smoke`).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np

from pd_cluster.bench.scripts.gpu_common import Row, Section
from pd_cluster.transfer import ucx_env
from pd_cluster.transfer.config import TransferConfig


def _descs(base: int, nbytes: int, desc_bytes: int, dev: int) -> np.ndarray:
    n = nbytes // desc_bytes
    out = np.empty((n, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(n, dtype=np.uint64) * desc_bytes
    out[:, 1] = desc_bytes
    out[:, 2] = dev
    return out


def _target(conn, nbytes: int, use_cuda: bool) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0" if use_cuda else "cpu")
    ucx_env.apply(TransferConfig())  # the workers' UCX environment (ucx_env's module doc)
    agent = nixl_agent("bench-target", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    peer_meta = conn.recv()
    agent.add_remote_agent(peer_meta)
    conn.recv()  # the initiator is done
    checksum = int(buf[: 1 << 20].to(torch.int64).sum())
    conn.send(checksum)
    conn.close()


def _initiator(conn, nbytes: int, desc_bytes: int, iters: int, use_cuda: bool) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    dev = "cuda:0" if use_cuda else "cpu"
    mem = "VRAM" if use_cuda else "DRAM"
    buf = torch.randint(1, 255, (nbytes,), dtype=torch.uint8, device=dev)
    ucx_env.apply(TransferConfig())  # the workers' UCX environment (ucx_env's module doc)
    agent = nixl_agent("bench-initiator", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([buf])
    peer_meta, peer_base = conn.recv()
    name = agent.add_remote_agent(peer_meta)
    name = name.decode() if isinstance(name, bytes) else name
    conn.send(agent.get_agent_metadata())
    local = agent.get_xfer_descs(_descs(buf.data_ptr(), nbytes, desc_bytes, 0), mem)
    remote = agent.get_xfer_descs(_descs(peer_base, nbytes, desc_bytes, 0), mem)
    times = []
    for i in range(iters + 2):
        handle = agent.initialize_xfer("WRITE", local, remote, name, b"bench")
        t = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        dt = time.perf_counter() - t
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if i >= 2:  # the first two connect and warm up
            times.append(dt)
    conn.send("done")
    want = int(buf[: 1 << 20].to(torch.int64).sum())
    got = conn.recv()
    conn.send((times, want == got))
    conn.close()


def measure(nbytes: int, desc_bytes: int, iters: int, use_cuda: bool, timeout_s: float = 300) -> tuple[float, bool]:
    """Median seconds of one WRITE of `nbytes`, and whether the target's bytes match (first MiB checksum)."""
    ctx = mp.get_context("spawn")
    a_t, b_t = ctx.Pipe()
    a_i, b_i = ctx.Pipe()
    target = ctx.Process(target=_target, args=(b_t, nbytes, use_cuda), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(b_i, nbytes, desc_bytes, iters, use_cuda), daemon=True)
    target.start()
    initiator.start()
    try:
        deadline = time.monotonic() + timeout_s

        def relay(src, dst):
            if not src.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("NIXL benchmark process did not answer")
            dst.send(src.recv())

        relay(a_t, a_i)  # target metadata -> initiator
        relay(a_i, a_t)  # initiator metadata -> target
        relay(a_i, a_t)  # done -> target
        relay(a_t, a_i)  # checksum -> initiator
        if not a_i.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("NIXL initiator did not report")
        times, ok = a_i.recv()
    finally:
        for p in (initiator, target):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return statistics.median(times), ok


def nixl_table(copy_gbps: float | None, use_cuda: bool, smoke: bool) -> Section:
    mem = "VRAM" if use_cuda else "DRAM"
    sec = Section(f"NIXL (UCX) {mem}-to-{mem} WRITE between two processes on one device",
                  ["size (MiB)", "descriptor (KiB)", "time (ms)", "GB/s", "% of copy (bytes once)", "data ok"])
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        sec.notes.append(f"skipped: NIXL is not installed here ({e}); see docs/gpu.md for carrying its wheels.")
        return sec
    sizes = ([(1 << 30, 4 << 20), (1 << 30, 256 << 10), (256 << 20, 4 << 20), (1 << 30, 1 << 30),
              (1 << 30, 64 << 20), (1 << 30, 16 << 20)] if not smoke else [(8 << 20, 1 << 20)])
    for nbytes, desc in sizes:
        try:
            t, ok = measure(nbytes, desc, 5 if not smoke else 2, use_cuda)
        except Exception as e:
            sec.rows.append(Row([nbytes >> 20, desc >> 10, "failed", repr(e)[:80], "", ""]))
            continue
        gbps = nbytes / t / 1e9
        ref = copy_gbps / 2 if copy_gbps else None  # the copy ceiling counts read + write
        sec.rows.append(Row([nbytes >> 20, desc >> 10, t * 1e3, gbps, 100 * gbps / ref if ref else "-", ok]))
    sec.notes.append("A device-to-device copy of N bytes moves N bytes once but counts 2N in the copy ceiling, "
                     "so the comparison uses half the measured copy bandwidth. 4 MiB descriptors are one Llama-3.1-8B "
                     "FP8 page of 64 tokens (all layers); 256 KiB ones are smaller page runs; 16 MiB to 1 GiB ones are runs of "
                     "consecutive pages, which the sender merges into one descriptor (`transfer/descriptors.py`).")
    return sec
