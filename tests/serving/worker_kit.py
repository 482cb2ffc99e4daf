"""A real mixed worker (the embedded stories260K model) served by uvicorn on loopback, in this process."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from pd_cluster.engine.args import config_from_kwargs
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.launch.cluster import free_port
from pd_cluster.serving.mixed import build_mixed_app
from pd_cluster.serving.worker_app import WorkerConfig

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and",
    "Lily wanted to bake a cake for her mom, so she",
    "Tom and Sue found a big box in the garden. Inside the box there was",
    "One sunny day, a small bird sat on a branch and sang a happy song. A cat saw the bird and",
    "There was a boy named Ben who loved trucks.",
    "Sam had a red ball.",
    "The sun was hot, and",
]


class InProcessWorker:
    """A mixed worker app on a uvicorn server in a thread; ``url`` once started."""

    def __init__(self, **engine_kwargs) -> None:
        kwargs = dict(kv_cache_memory="64MiB", cpu_threads=1)
        kwargs.update(engine_kwargs)
        self.engine = LLMEngine(config_from_kwargs(**kwargs))
        self.app = build_mixed_app(self.engine, WorkerConfig(engine=self.engine.config), {"url": "", "incarnation": "test"},
                                   exit_on_fatal=False)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def loop(self):
        return self.app.state.worker.loop

    def start(self, timeout: float = 60.0) -> "InProcessWorker":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the worker did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@contextlib.contextmanager
def running_worker(**engine_kwargs):
    w = InProcessWorker(**engine_kwargs).start()
    try:
        yield w
    finally:
        w.stop()
