"""CPU starvation for overload benchmarks and tests: busy-loop processes started and stopped by pid.

Each hog is ``python -c "while True: pass"`` in its own session; `cpu_hogs` starts them, yields their pids and
stops exactly those (SIGKILL by pid) on exit, whatever happened inside. `load_average` reads the 1-minute load
of ``/proc/loadavg``, to report how loaded the machine was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

HOG = "while True: pass"


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[list[int]]:
    """Run `count` busy-loop processes (each wants a whole core) while the block runs; yield their pids."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait()


def load_average() -> float:
    """The 1-minute load average (``/proc/loadavg``); 0.0 where it cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
