"""How an instance starts its rank processes on one host: forked from a forkserver that imported torch once.

Under ``spawn`` every rank is a fresh interpreter that imports torch, the engine and the launching program's main
module (a worker's: uvicorn, FastAPI, transformers) again. A forkserver (Python's `multiprocessing` ``forkserver``
start method, which PyTorch documents beside ``spawn`` for CUDA) imports those once and forks every rank from
itself. On a 2-core machine a spawned TP rank of the embedded model used 2.3 s of CPU before it served, a forked one
0.4-1.0 s. The server starts with the first rank of the process's life and serves every later one, so an engine
built again in the same process (as the tests do, many times) starts its ranks for the cost of a fork and their own
set-up.

The server must never touch a device: nothing it preloads calls into ``torch.cuda`` at import
(`tests/engine/test_rank_procs.py` checks), so each forked rank initialises CUDA itself, as a spawned one does.

What stays as under ``spawn``:

* **Environment:** the server keeps the environment it started with; each rank gets its launcher's environment as
  of the rank's start (`rank_process` carries a copy, applied before the rank's target runs). Only the modules
  preloaded into the server (`preload_modules`) were imported under the server's; none of them reads a setting of
  this project at import.
* **Lifetime:** a rank is a `multiprocessing.Process` (its ``pid``, ``sentinel``, ``exitcode``, ``kill`` and
  ``daemon`` as before), in its launcher's process group, so the launcher's signals to that group reach it as
  before. A rank that must die with its launcher by ``PR_SET_PDEATHSIG`` (a node's ranks,
  `pd_cluster.engine.executor.node`; a DP decode instance's, `pd_cluster.decode.dp_instance`, which also leave the
  group to outlive rank 0's drain) is still spawned: a forked rank's parent is the server, which a signal to
  the group stops.

Where the platform has no ``forkserver`` (not Linux or macOS), ranks are spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

_BASE_PRELOAD = ("torch",)


def preload_modules(target: Callable[..., Any]) -> list[str]:
    """What the forkserver imports before forking: torch, the module of the ranks' `target`, and the launching
    program's main module when it is run by name (``python -m pd_cluster.launch.worker``: every rank imports it
    as ``__mp_main__`` anyway, and a forked rank finds its imports done)."""
    mods = [*_BASE_PRELOAD, target.__module__]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name and name.startswith("pd_cluster.") and not name.endswith("__main__"):
        mods.append(name)
    return mods


def rank_context(target: Callable[..., Any]) -> BaseContext:
    """The start method of rank processes: ``forkserver`` (preloading `preload_modules(target)` when the server
    is not running yet), else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload_modules(target))  # no effect once the server runs: it keeps its modules
    return ctx


def rank_process(target: Callable[..., Any], args: tuple, name: str, daemon: bool = True) -> mp.Process:
    """A rank process (not started) that runs ``target(*args)`` with this process's environment of now.

    Args:
        target: a module-level function (it is pickled by reference).
        args: its arguments (pickled; pipes and sockets are passed as `multiprocessing` passes them).
        name: the process's name (``tp-rank-1``).
        daemon: killed when this process exits normally, as `multiprocessing.Process`'s ``daemon``.
    """
    ctx = rank_context(target)
    return ctx.Process(target=_run_with_environment, args=(dict(os.environ), target, args), name=name,
                       daemon=daemon)


def _run_with_environment(env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def stop_rank_processes(timeout: float = 10.0) -> list[str]:
    """SIGKILL the rank processes this process started that still run (`multiprocessing.active_children`), and wait
    up to `timeout` seconds for each to be gone; returns their names.

    A worker calls it last, after its server drained: the ranks would die anyway (by ``PR_SET_PDEATHSIG`` or their
    lost group), but only some moments after the worker, so whoever waits for the worker's exit (``pd-serve``,
    Kubernetes) could still find one answering on its port.
    """
    ranks = mp.active_children()
    for p in ranks:
        p.kill()
    for p in ranks:
        p.join(timeout)
    return [p.name for p in ranks]
