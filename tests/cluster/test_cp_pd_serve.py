"""Context-parallel prefill through `pd-serve` 1P1D (`--prefill-arg=--prefill-context-parallel-size=2`): the
prefill worker's two rank processes split each prompt chunk, rank 0 (whose pool holds every token's KV) pushes
the pages over its NIXL agent, and the real `openai` client gets transformers' greedy tokens from a tiny random
Llama 3 checkpoint, with prompts longer than the chunked-prefill size; every page comes back on both sides."""

from __future__ import annotations

import httpx
import psutil
import pytest
from cluster_util import greedy_token_ids, running_pd_serve
from reuse_util import counters
from test_moe_pd_serve import _wait_all_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE = ["--kv-cache-dtype", "fp32", "--page-size", "16", "--chunked-prefill-size", "24"]
MAX_TOKENS = 12


def _rank_processes(pid: int) -> list[psutil.Process]:
    """The rank processes of the worker `pid`: spawned (``spawn_main``) or forked by its forkserver (a child of
    the server, with the server's command line; `pd_cluster.engine.executor.rank_procs`)."""
    ranks = []
    for c in psutil.Process(pid).children(recursive=True):
        cmd = " ".join(c.cmdline())
        if "spawn_main" in cmd or ("multiprocessing.forkserver" in cmd and c.ppid() != pid):
            ranks.append(c)
    return ranks


def test_llama3_cp2_prefill_worker_equals_transformers(tmp_path):
    from random_models import build, hf_greedy_batch, long_prompt_ids

    model = tmp_path / "llama3-tiny"
    hf = build("llama3-rope-scaling", model, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    prompts = long_prompt_ids(3, (40, 53, 71))
    expected = hf_greedy_batch(hf, prompts, MAX_TOKENS)
    argv = ["--model", str(model), *ENGINE, "--prefill-arg=--prefill-context-parallel-size=2"]
    with running_pd_serve(tmp_path / "manifest.json", argv) as (url, manifest):
        workers = {w["role"]: w["url"] for w in manifest["workers"]}
        pids = {w["role"]: w["pid"] for w in manifest["workers"]}
        info = {role: httpx.get(u + "/server_info").json() for role, u in workers.items()}
        assert [info[r]["prefill_context_parallel_size"] for r in ("prefill", "decode")] == [2, 1]
        assert len(_rank_processes(pids["prefill"])) == 1  # rank 1's process
        assert greedy_token_ids(url, model.name, prompts, MAX_TOKENS) == expected
        loads = _wait_all_free(workers, timeout=10)
        assert all(v["num_free_pages"] == v["num_total_pages"] for v in loads.values()), loads
        pushed = counters(workers["prefill"])["pd:kv_transfer_bytes_total"]
        received = counters(workers["decode"])["pd:kv_transfer_received_bytes_total"]
    page_bytes = 3 * 2 * 2 * 16 * 16 * 4  # layers x K,V x KV heads x tokens x head_dim x fp32
    assert pushed == received == sum(-(-len(ids) // 16) for ids in prompts) * page_bytes, (pushed, received)
