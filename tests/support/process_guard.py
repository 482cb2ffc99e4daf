"""`ProcessGuard`: while active, starting a process fails the test (the rule of the not-slow tier).

The fast tier (``pytest -m "not slow"``) starts no process: no worker, router, cluster, tensor-parallel rank,
script, ``pip``, ``helm`` or ``git``. `tests/conftest.py` activates a guard around the set-up, call and
tear-down of every test not marked ``slow``. The guard replaces every way Python starts a process
(`subprocess.Popen`, hence `subprocess.run` and asyncio's subprocesses; `os.fork`, `os.forkpty`,
`os.posix_spawn`, `os.posix_spawnp`, `os.system`; `_posixsubprocess.fork_exec`, which `multiprocessing`'s
spawn and forkserver use) with one that records the attempt and raises `ProcessInNotSlowTest`. A test that
swallows the error still fails: the recorded attempt is reported when the phase ends.

One exception (`ALLOWED_TOOLS`): the C compiler, which builds the CPU attention kernel once per machine
(`pd_cluster.engine.attention.cpu_backend`, cached under ``$PD_CACHE_DIR``); a build step, not a server.
`answer_processor_without_uname` removes the one other process the fast tier used to start.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import _posixsubprocess

ALLOWED_TOOLS = frozenset({"cc", "gcc", "clang", Path(os.environ.get("CC", "cc")).name})
"""Executables a not-slow test may run: the C compiler of the CPU kernel's one-time build."""


def answer_processor_without_uname() -> None:
    """Fill `platform.processor()` from `platform.machine()` (what ``uname -p`` prints on Linux) so that it is never
    computed by running ``uname -p``, which the standard library does once per process; the `openai` client asks
    for it (through `platform.platform()`) for its request headers."""
    platform.uname().__dict__.setdefault("processor", platform.machine())


class ProcessInNotSlowTest(RuntimeError):
    """A test that is not marked ``slow`` tried to start a process."""


_OS_CALLS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")


class ProcessGuard:
    """Refuse process creation while active (a context manager).

    Args:
        where: what is running (a test's node id), for the error message.
        enabled: False makes the guard a no-op (a ``slow`` test).

    Attributes:
        attempts: the refused attempts, as one line each.
        current: (class attribute) the innermost active guard, None when none is.
    """

    current: ProcessGuard | None = None

    def __init__(self, where: str, enabled: bool = True) -> None:
        self.where = where
        self.enabled = enabled
        self.attempts: list[str] = []
        self._saved: list[tuple[object, str, object]] = []
        self._outer: ProcessGuard | None = None

    def _refuse(self, what: str) -> ProcessInNotSlowTest:
        line = f"{what} (in {self.where})"
        self.attempts.append(line)
        return ProcessInNotSlowTest(f"a test that is not marked slow started a process: {line}; mark it "
                                    f"@pytest.mark.slow (tests/conftest.py)")

    def _patch(self, owner: object, name: str, replacement: object) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def __enter__(self) -> ProcessGuard:
        if not self.enabled:
            return self
        guard = self
        execute_child = subprocess.Popen._execute_child

        def guarded_execute_child(popen, args, executable, *rest, **kwargs):
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            program = os.fsdecode(executable or argv[0]).split()[0] if argv else "?"
            if Path(program).name not in ALLOWED_TOOLS:
                raise guard._refuse(f"subprocess {os.fsdecode(argv[0]) if argv else '?'!r}")
            return execute_child(popen, args, executable, *rest, **kwargs)

        self._patch(subprocess.Popen, "_execute_child", guarded_execute_child)
        for name in _OS_CALLS:
            if hasattr(os, name):
                self._patch(os, name, self._refuser(f"os.{name}"))
        self._patch(_posixsubprocess, "fork_exec", self._refuser("_posixsubprocess.fork_exec (multiprocessing)"))
        self._outer, ProcessGuard.current = ProcessGuard.current, self
        return self

    def _refuser(self, what: str):
        def refuse(*args, **kwargs):
            raise self._refuse(what)
        return refuse

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        ProcessGuard.current = self._outer
