"""Local clusters for the GPU first contact's end-to-end and handover steps (`first_contact_e2e`,
`first_contact_handover`): started in the background so that several come up together, then used through their
router with the real HTTP path.

Every worker of a cluster here shares the machine's one device (``num_gpus`` 1, or 0 on CPU) and is given its
memory explicitly (``--kv-cache-memory``), so the launcher adds no ``--mem-fraction-static`` and several
clusters fit on one GPU at once.
"""

from __future__ import annotations

import threading
import time

import httpx

from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, free_port


def start(engine_argv: list[str], colocated: bool = False, log_level: str = "info") -> LocalCluster:
    """Spawn a 1P1D cluster (or one mixed worker with `colocated`) and its router on this machine's device;
    returns at once (`wait_ready` next)."""
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    spec = ClusterSpec(num_prefill=1, num_decode=1, colocated=colocated, num_workers=1 if colocated else 0,
                       router_port=free_port(), engine_argv=list(engine_argv), log_level=log_level, echo=False,
                       num_gpus=min(num_gpus, 1), mem_fraction_given=True, shutdown_grace_period_secs=5.0)
    cluster = LocalCluster(spec)
    cluster.start()
    return cluster


def wait_ready(cluster: LocalCluster, deadline: float) -> float:
    """Wait until the router can route (monotonic `deadline`); returns the seconds since the cluster started.

    Raises:
        RuntimeError: a process exited, or the deadline passed (with the processes' last lines).
    """
    t0 = min(p.restarts.started_at or time.monotonic() for p in cluster.procs)
    try:
        cluster.wait_ready(timeout=max(1.0, deadline - time.monotonic()), every_worker=False)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{tails(cluster)}") from None
    return time.monotonic() - t0


def tails(cluster: LocalCluster, n: int = 30) -> str:
    """The last `n` lines each process of `cluster` printed."""
    return "\n".join(f"----- last lines of {name} -----\n" + "".join(list(log)[-n:])
                     for name, log in cluster.logs.items())


def complete(cluster: LocalCluster, model: str, prompts: list, max_tokens: int,
             timeout_s: float) -> tuple[list[str], list[list[int]]]:
    """Greedy completions (``ignore_eos``) of `prompts` (texts or token-id lists) one after the other through the
    router; returns their texts and token ids."""
    texts, ids = [], []
    with httpx.Client(timeout=timeout_s) as client:
        for prompt in prompts:
            r = client.post(cluster.router_url + "/v1/completions",
                            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            texts.append(choice["text"])
            ids.append(list(choice["token_ids"]))
    return texts, ids


def stop_all(clusters) -> None:
    """Stop every cluster given, all at once (each bounded: 5 s for its router to drain, 15 s for its workers)."""
    def stop(cluster: LocalCluster) -> None:
        try:
            cluster.stop()
        except Exception as e:  # noqa: BLE001 - stop the others anyway
            print(f"[first_contact] stopping a cluster failed: {e!r}", flush=True)

    threads = [threading.Thread(target=stop, args=(c,), daemon=True) for c in clusters]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
