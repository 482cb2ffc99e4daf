"""Host time of building one decode step's inputs on rank 0: host-rebuilt block tables vs device rows.

``python -m pd_cluster.bench.scripts.host_step [--device cpu|cuda] [--threads 1]``

Steady decode: every request gains one token per step and a page every `PAGE` tokens. Two paths, both
ending with the step's `ForwardBatch` on `device` (no model run):

- ``rebuilt``: the path before device block tables (commit aa6ad87): per request a numpy array of its new
  tokens and its whole page list, then `build_forward_batch`, which fills a [B, max_pages] host table and
  uploads it through `HostStaging` every step.
- ``device rows``: `ModelRunner._build_batch` (rows and appends from `BlockTableRows`, `pack_step`), then what
  every rank runs (`unpack_step`, `build_step`: edits applied to a persistent `DeviceBlockTable`, the step's
  table gathered on the device).
"""

from __future__ import annotations

import argparse
import timeit
import types

import numpy as np
import torch

from pd_cluster.engine.batch import HostStaging, build_forward_batch
from pd_cluster.engine.block_tables import BlockTableRows, DeviceBlockTable
from pd_cluster.engine.model_runner import ModelRunner
from pd_cluster.engine.packed_step import HEADER_LEN, build_step, unpack_step
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.scheduler.output import ScheduledRequest

PAGE = 16


def make_requests(bs: int, ctx: int) -> list[Request]:
    reqs, nxt = [], 1
    for i in range(bs):
        r = Request(f"r{i}", list(range(ctx)), SamplingParams(max_tokens=10**6))
        r.token_ids.append(5)
        pages = -(-(ctx + 1) // PAGE)
        r.block_table = list(range(nxt, nxt + pages))
        nxt += pages + 64
        r.num_computed_tokens = ctx
        reqs.append(r)
    return reqs


def advance(reqs: list[Request]) -> None:
    for r in reqs:
        r.num_computed_tokens += 1
        r.token_ids.append(7)
        if -(-r.num_tokens // PAGE) > len(r.block_table):
            r.block_table.append(r.block_table[-1] + 1)


def rebuilt_step(reqs: list[Request], device: torch.device, staging: HostStaging):
    items = [ScheduledRequest(r, r.num_computed_tokens, 1) for r in reqs]
    ids = [np.asarray(it.req.token_ids[it.start:it.end], dtype=np.int64) for it in items]
    rows = [np.asarray([it.num_new_tokens - 1] if ModelRunner._prompt_logprob_count(it) == 0 else [],
                       dtype=np.int64) for it in items]
    batch = build_forward_batch(ids, [it.start for it in items], [it.req.block_table for it in items], rows,
                                len(items), PAGE, device, staging)
    advance(reqs)
    return batch


def device_rows_step(runner: ModelRunner, table: DeviceBlockTable, reqs: list[Request], staging: HostStaging):
    items = [ScheduledRequest(r, r.num_computed_tokens, 1) for r in reqs]
    step, *_ = runner._build_batch(items, len(items))
    batch = build_step(unpack_step(step[:HEADER_LEN], step[HEADER_LEN:]), table, PAGE, staging)
    advance(reqs)
    return batch


def device_rows_runner(device: torch.device) -> tuple[ModelRunner, DeviceBlockTable, HostStaging]:
    """A `ModelRunner` with only what `_build_batch` uses, a device table and staging buffers."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.pool = types.SimpleNamespace(page_size=PAGE)
    runner.rows = BlockTableRows()
    runner.num_groups = 1  # one KV group (a model without local layers)
    return runner, DeviceBlockTable(device), HostStaging(device)


def measure(fn, n: int = 200) -> float:
    """Best of 5 runs of `n` steps, seconds per step (after one warm-up run)."""
    fn()
    return min(timeit.repeat(fn, number=n, repeat=5)) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for bs, ctx in ((64, 2048), (28, 32768)):
        reqs = make_requests(bs, ctx)
        staging = HostStaging(device)
        before = measure(lambda: (rebuilt_step(reqs, device, staging), sync()))
        reqs = make_requests(bs, ctx)
        runner, table, staging = device_rows_runner(device)
        after = measure(lambda: (device_rows_step(runner, table, reqs, staging), sync()))
        print(f"batch {bs:3d}, {ctx:6d}-token contexts, page {PAGE}: rebuilt {before * 1e6:7.0f} us/step, "
              f"device rows {after * 1e6:7.0f} us/step ({before / after:.1f}x)")


if __name__ == "__main__":
    main()
