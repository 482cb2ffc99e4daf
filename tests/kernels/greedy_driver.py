"""A small greedy generation loop over the real model, pool and batch builder, for backend comparisons.

Each step: requests still in their prompt get a chunk of at most `chunk`
tokens (chunked prefill over already-cached pages), the others decode one
token; decodes come first, so steps mix decode and prefill while prompts of
different lengths finish at different steps. Decode-only steps go through a
`CudaGraphRunner` when one is given.
"""

from __future__ import annotations

import numpy as np
import torch

from pd_cluster.engine.attention.base import AttentionBackend
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.graph import CudaGraphRunner
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.loader import LoadedModel


def make_pool_for(loaded: LoadedModel, kv_dtype: str, page_size: int, num_pages: int, device) -> KVPool:
    arch = loaded.arch
    n = arch.num_hidden_layers
    scales = tuple(0.05 + 0.01 * i for i in range(n)) if kv_dtype == "fp8_e4m3" else (1.0,) * n
    layout = KVLayout(n, arch.num_key_value_heads, arch.head_dim, page_size, kv_dtype, scales, scales)
    return KVPool(layout, num_pages, device, loaded.dtype)


def greedy(loaded: LoadedModel, pool: KVPool, backend: AttentionBackend, prompts: list[list[int]],
           max_new: int, chunk: int, graph_runner: CudaGraphRunner | None = None) -> tuple[list[list[int]], int]:
    """Greedy continuations of `prompts`; also returns how many steps went through `graph_runner`.

    Pages are handed out disjointly (request i gets a contiguous run, in reverse
    order so that block tables are not the identity).
    """
    ps = pool.page_size
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    tables, next_page = [], 1
    for p in prompts:
        need = -(-(len(p) + max_new) // ps)
        tables.append(list(range(next_page + need - 1, next_page - 1, -1)))
        next_page += need
    if next_page - 1 > pool.num_pages:
        raise ValueError("pool too small for the prompts")
    graph_steps = 0
    while any(len(o) < max_new for o in out):
        live = [i for i in range(len(prompts)) if len(out[i]) < max_new]
        decodes = [i for i in live if computed[i] == len(tokens[i]) - 1 and out[i]]
        prefills = [i for i in live if i not in decodes]
        order = decodes + prefills
        ids, starts, rows, ends = [], [], [], []
        for i in order:
            end = len(tokens[i]) if i in decodes else min(len(tokens[i]), computed[i] + chunk)
            ids.append(np.asarray(tokens[i][computed[i]:end], dtype=np.int64))
            starts.append(computed[i])
            rows.append(np.array([end - computed[i] - 1]) if end == len(tokens[i]) else np.zeros(0, dtype=np.int64))
            ends.append(end)
        batch = build_forward_batch(ids, starts, [tables[i] for i in order], rows, len(decodes), ps, pool.device)
        if graph_runner is not None and graph_runner.can_run(batch):
            logits = graph_runner.replay(batch)
            graph_steps += 1
        else:
            logits = loaded.model(batch, pool, backend)
        nxt = logits.argmax(-1).tolist()
        k = 0
        for i, end in zip(order, ends):
            computed[i] = end
            if end == len(tokens[i]):
                tokens[i].append(int(nxt[k]))
                out[i].append(int(nxt[k]))
                k += 1
    return out, graph_steps
