"""A decode worker with data-parallel attention: ``pd-worker --role decode --tp-size N --dp-size N
--enable-dp-attention [--enable-expert-parallel]`` (SGLang's flags and meaning; pd-serve's ``--decode-arg``).

The instance is N DP rank processes. Each is a whole decode server (`build_decode_app`): its own `LLMEngine`
(scheduler, page allocator, prefix cache, KV pool, requests; attention, dense layers, embeddings and head whole),
its own KV transfer agent over its own pool, and its own HTTP server; only the MoE layers are shared, over the
group of all ranks (`pd_cluster.engine.parallel.dp_attention`: all-gather/reduce-scatter, or the routed all-to-all
with expert parallelism). Rank 0 runs in the worker's own process and serves the instance's URL; ranks 1..N-1 are
child processes, each serving a port of its own on the same ``--host`` (its URL has the instance's advertised
host), which die with it.

- **Which rank**: rank 0's front (`pd_cluster.decode.dp_dispatch.DPDispatch`) gives each OpenAI request to one rank:
  the body's ``data_parallel_rank`` (SGLang's field) pins it, else the rank with the fewest requests in flight.
- **KV**: the chosen rank's decode server runs the request's remote prefill as any decode worker does, naming its own
  URL and its own agent's ticket, so the prefill worker fetches that rank's metadata, meets that rank's agent, and
  pushes the request's pages into that rank's pool only (any prefill TP size: each DP rank is, for the transfer, a
  decode worker of attention TP ``tp / dp`` = 1; `pd_cluster.transfer.tp_plan`).
- **Lockstep**: every rank's step loop asks the others each iteration whether any has work and then steps once
  with them, a rank without work running the idle pass of its MoE layers (`DPLockstep`, in `EngineLoop`).
- **One unit**: a rank process that dies takes rank 0's process down (exit status 70), and rank 0's takes the
  others (``PR_SET_PDEATHSIG``), so the supervisor restarts the instance whole; ``/health`` is 200 only when every
  rank's is.

Refused at start-up, naming the flag: everything `check_dp_attention` refuses, and any role but decode.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx

from pd_cluster.common.net import free_port
from pd_cluster.engine.executor.dp import START_TIMEOUT_S, check_dp_attention, rank_config
from pd_cluster.engine.executor.tp import rank_device
from pd_cluster.serving.worker_app import ENGINE_DEAD_EXIT_CODE, WorkerConfig, install_internal_auth

logger = logging.getLogger("pd.decode")


def rank_worker_config(config: WorkerConfig, rank: int, port: int) -> WorkerConfig:
    """DP rank `rank`'s own decode server: its engine config (`rank_config`), and for rank > 0 its own port on the
    instance's host (its URL keeps the instance's advertised host)."""
    engine = rank_config(config.engine, rank)
    if rank == 0:
        return dataclasses.replace(config, engine=engine)
    host = urlsplit(config.url).hostname or config.host
    host = f"[{host}]" if ":" in host else host
    return dataclasses.replace(config, engine=engine, port=port, advertise_url=f"http://{host}:{port}")


def _rank_main(rank: int, size: int, master: tuple[str, int], config: WorkerConfig) -> None:
    """DP rank `rank` > 0's process: join the group, build its engine and decode server, serve until killed."""
    import uvicorn

    from pd_cluster.engine.executor.tp import _die_with_parent

    _die_with_parent()
    os.setsid()  # the launcher's signals to rank 0's group stop rank 0, whose exit stops this rank
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s dp{rank} %(name)s: %(message)s")
    app = install_internal_auth(_rank_app(rank, size, master, config), config)
    uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                                  access_log=False)).run()


def _rank_app(rank: int, size: int, master: tuple[str, int], config: WorkerConfig, urls: tuple[str, ...] = ()):
    from pd_cluster.decode.server import build_decode_app
    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.engine.parallel.dp_attention import init_dp_group

    group = init_dp_group(rank, size, master, rank_device(config.engine, 0))
    engine = LLMEngine(config.engine, group=group)
    info = {"url": config.url, "incarnation": uuid.uuid4().hex[:12], "pid": os.getpid(), "dp_rank": rank,
            "dp_size": size, **({"dp_urls": list(urls)} if urls else {})}
    return build_decode_app(engine, config, info)


def build_dp_decode_app(config: WorkerConfig):
    """Start DP ranks 1..N-1 (child processes), build rank 0 here, and return rank 0's app with the instance's front
    (`DPDispatch`) and internal auth, once every rank's server listens.

    Raises:
        ValueError: a refused setting, naming the flag (`check_dp_attention`; a role other than decode).
        RuntimeError: a rank died or did not listen within `START_TIMEOUT_S`.
    """
    from pd_cluster.decode.dp_dispatch import DPDispatch

    check_dp_attention(config.engine, roles=("decode",))
    size = config.engine.parallel.dp_size
    master = ("127.0.0.1", free_port())  # every rank lives on this host
    configs = [rank_worker_config(config, r, free_port() if r else config.port) for r in range(size)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, size, master, configs[r]), daemon=True, name=f"dp-rank-{r}")
             for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        app = _rank_app(0, size, master, configs[0], tuple(c.url for c in configs))
        _wait_listening(procs, [c.url for c in configs[1:]])
    except BaseException:
        for p in procs:
            p.kill()
        raise
    threading.Thread(target=_watch, args=(procs,), name="dp-rank-watch", daemon=True).start()
    app.add_middleware(DPDispatch, urls=[c.url for c in configs])  # inside the internal key's check
    app = install_internal_auth(app, config)
    logger.info("DP attention decode instance: %d ranks (%s), expert parallel %s", size,
                ", ".join(c.url for c in configs), config.engine.parallel.enable_expert_parallel)
    return app


def _wait_listening(procs: list, urls: list[str]) -> None:
    """Return once every child rank's server answers (any status: it may still be meeting its peers)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for p, url in zip(procs, urls):
        while True:
            if not p.is_alive():
                raise RuntimeError(f"DP rank process {p.name} exited during start-up (exit code {p.exitcode})")
            try:
                httpx.get(url + "/health", timeout=2.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"DP rank process {p.name} did not listen at {url} within "
                                       f"{START_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)


def _watch(procs: list) -> None:
    """Exit this process (rank 0, the instance) when a child rank dies: the instance restarts as a unit."""
    from multiprocessing.connection import wait

    wait([p.sentinel for p in procs])
    dead = next(p for p in procs if not p.is_alive())
    logger.critical("DP rank process %s died (exit code %s): exiting with status %d so that the instance restarts "
                    "whole", dead.name, dead.exitcode, ENGINE_DEAD_EXIT_CODE)
    os._exit(ENGINE_DEAD_EXIT_CODE)
