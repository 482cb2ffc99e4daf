"""The page runs a KV transfer moves once the pools are loaded: the engine's own page managers driven by a trace.

A fresh pool hands a request consecutive pages, so its transfer is one NIXL descriptor; a pool that has run for
a while is fragmented: requests finish in any order, decodes take one page at a time, and the prefix caches keep
pages until they are evicted. The descriptors a real transfer uses are the runs of pages consecutive on both
sides (`transfer.descriptors.page_runs`), so their number depends on both pools' histories.

`simulate` replays the Mooncake conversation trace shipped in ``bench/data`` (real prompt and output lengths,
prompts sharing prefixes through their 512-token ``hash_ids``, `prefix_cache.load_trace`) through two
`PageManager`s with prefix caches (`engine/scheduler/page_manager.py`, `engine/kv/prefix_cache.py`):

- decode side: a request is admitted when its prompt's pages fit (`reserve_remote`, after matching the decode
  worker's own prefix cache: only the pages past the match are transferred), then takes one page per
  `page_size` generated tokens (`grow`), and at its end caches its pages and releases them;
- prefill side: each admitted request prefills one chunk of at most `chunk` tokens per tick, round robin with
  the others (`grow` per chunk, after a prefix-cache `match`); each chunk's newly complete pages are one push,
  as `KVSender.push` makes them; at the last chunk the pages are cached and released.

Every tick each running decode generates a token. After `warmup` requests have finished, probe requests of
exactly the `probe_lengths` (fresh token ids: no prefix hit) join the stream; their pushes' (prefill pages,
decode pages) are recorded, and the run counts of every transfer are kept for the distribution.

The page managers, allocators and prefix caches are the engine's own; only the model is absent (pages, not
values, are simulated). Pure Python: about a second per thousand requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.prefix_cache import PrefixCache
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.scheduler.page_manager import PageManager
from pd_cluster.transfer.descriptors import page_runs

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_1000.jsonl"


@dataclass
class Transfer:
    """One request's KV transfer: its pushes as (prefill pages, decode pages) pairs, in order."""

    prompt_tokens: int
    pushes: list[tuple[list[int], list[int]]] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(len(s) for s, _ in self.pushes)

    @property
    def num_runs(self) -> int:
        return sum(page_runs(s, d).num_runs for s, d in self.pushes if s)


@dataclass
class PoolHistory:
    """What `simulate` saw: every transfer's run count, the probes' transfers, and the pools' use at the probes."""

    runs_per_transfer: list[int]
    pages_per_transfer: list[int]
    probes: list[Transfer]
    decode_use: list[float]
    finished: int


class _Live:
    def __init__(self, req: Request, dec: Request, output: int, probe: bool) -> None:
        self.req, self.dec, self.output, self.probe = req, dec, output, probe
        self.transfer = Transfer(len(req.prompt_token_ids))
        self.first_page = 0  # decode pages before it came from decode's own prefix cache
        self.sent = 0        # prompt pages pushed so far (prefill side, from first_page)


def simulate(num_pages: int, page_size: int = 64, chunk: int = 8192, num_requests: int = 600, warmup: int = 200,
             probe_lengths: tuple[int, ...] = (2048, 8192), probes_each: int = 3, max_output: int = 512,
             max_prefills: int = 8, seed: int = 0) -> PoolHistory:
    """Replay the trace through a prefill and a decode page manager of `num_pages` pages each (module doc).

    At most `max_prefills` requests prefill at once; outputs are capped at `max_output` tokens (probes: 16).
    """
    from pd_cluster.bench.scripts.prefix_cache import load_trace

    trace = load_trace(TRACE, num_requests, 512, 32, max_output, seed)
    rng = np.random.default_rng(seed + 1)
    managers = []
    for _ in range(2):
        alloc = PageAllocator(num_pages)
        managers.append(PageManager(alloc, page_size, PrefixCache(alloc, page_size)))
    prefill, decode = managers
    params = SamplingParams(max_tokens=1)
    queue = [(list(t.prompt), t.max_tokens, False) for t in trace]
    probes = [n for n in probe_lengths for _ in range(probes_each)]
    prefilling: list[_Live] = []
    decoding: list[_Live] = []
    hist = PoolHistory([], [], [], [], 0)
    next_id = 0
    while queue or prefilling or decoding:
        progressed = False
        probe_waiting = any(x.probe for x in prefilling) or (queue and queue[0][2])
        if hist.finished >= warmup and probes and not probe_waiting:
            queue.insert(0, (rng.integers(3, 512, size=probes.pop(0)).tolist(), 16, True))
        while queue and len(prefilling) < max_prefills:  # admission: decode holds the prompt, keeps room to grow
            prompt, output, probe = queue[0]
            dec = Request(f"d{next_id}", prompt, params, remote_kv=True)
            matched = decode.match(dec)
            need = decode.extra_pages(dec, dec.num_tokens)
            room = sum(-(-x.output // page_size) + 1 for x in decoding + prefilling)
            if need + room + -(-output // page_size) > decode.num_available:
                decode.release(dec)
                break
            queue.pop(0)
            decode.reserve_remote(dec)
            live = _Live(Request(f"p{next_id}", prompt, params), dec, output, probe)
            live.sent = live.first_page = matched // page_size
            live.req.num_computed_tokens = prefill.match(live.req)
            prefilling.append(live)
            next_id += 1
            progressed = True
        for live in list(prefilling):  # one chunk each, round robin
            req = live.req
            end = min(req.num_computed_tokens + chunk, req.num_tokens)
            if not prefill.can_grow(req, end):
                continue
            prefill.grow(req, end)
            req.num_computed_tokens = end
            progressed = True
            last = end >= req.num_tokens
            upto = -(-end // page_size) if last else end // page_size
            if upto > live.sent:
                live.transfer.pushes.append((req.block_table[live.sent:upto], live.dec.block_table[live.sent:upto]))
                live.sent = upto
            if last:
                prefill.cache_computed(req)
                prefill.release(req)
                prefilling.remove(live)
                live.dec.num_computed_tokens = live.dec.num_tokens
                decoding.append(live)
                hist.runs_per_transfer.append(live.transfer.num_runs)
                hist.pages_per_transfer.append(live.transfer.num_pages)
                if live.probe:
                    hist.probes.append(live.transfer)
                    hist.decode_use.append(decode.token_usage)
        for live in list(decoding):  # one token each
            dec = live.dec
            if not decode.can_grow(dec, dec.num_tokens + 1):
                continue
            dec.token_ids.append(int(rng.integers(3, 512)))
            decode.grow(dec, dec.num_tokens)
            dec.num_computed_tokens = dec.num_tokens
            live.output -= 1
            progressed = True
            if live.output <= 0:
                decode.cache_computed(dec)
                decode.release(dec)
                decoding.remove(live)
                hist.finished += 1
        if not progressed:
            raise RuntimeError(f"the simulation stalled: {len(queue)} queued, {len(prefilling)} prefilling, "
                               f"{len(decoding)} decoding; {num_pages} pages are too few for the trace")
    return hist
