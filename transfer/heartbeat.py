"""The thread that runs the KV sender's heartbeat (`KVSender.heartbeat`) while the step loop computes.

The step loop polls nothing during a forward pass, so the heartbeat cannot come from it: a daemon thread calls
the sender's `heartbeat` every period. SIGSTOP and kill stop this thread with the process, which is what lets
decode's deadline still find a frozen or dead prefill (docs/transfer.md, Deadlines).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class HeartbeatThread:
    """Calls `beat` every `period` seconds on a daemon thread, until `stop` or until `done()` is true.

    Args:
        beat: one heartbeat round (`KVSender.heartbeat`); its exceptions are logged, never end the thread.
        period: seconds between rounds (`TransferConfig.heartbeat_period`).
        done: checked before each round (e.g. the agent closed).
    """

    def __init__(self, beat: Callable[[], object], period: float, done: Callable[[], bool]) -> None:
        self.beat = beat
        self.period = period
        self.done = done
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-heartbeat", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.period) and not self.done():
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the thread must go on: without it a long chunk would time out
                logger.exception("KV transfer: heartbeat round failed")
