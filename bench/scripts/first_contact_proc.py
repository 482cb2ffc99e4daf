"""Child processes of the GPU first contact (`first_contact`): each in its own process group, stopped with its
children at a deadline (SIGTERM to the group, SIGKILL `KILL_GRACE_S` later)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KILL_GRACE_S = 5.0


def run_command(argv: list[str], deadline: float, log: Path | None = None, env: dict | None = None,
                cwd: Path = REPO, tick=None, tick_s: float = 5.0) -> tuple[int | None, float]:
    """Run `argv` until it exits or `deadline` (monotonic) passes; output appended to `log` (None: inherited);
    `tick()` is called every `tick_s` seconds while it runs.

    Returns:
        (exit status, or None when it was stopped at the deadline; seconds it ran).
    """
    t0 = time.monotonic()
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    fh = open(log, "a") if log is not None else None
    try:
        if fh is not None:
            fh.write(f"$ {' '.join(argv)}\n")
            fh.flush()
        else:
            print(f"$ {' '.join(argv)}", flush=True)
        proc = subprocess.Popen(argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT if fh else None, env=env,
                                start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.0, min(tick_s, deadline - time.monotonic())))
                    return rc, time.monotonic() - t0
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise
                    if tick is not None:
                        tick()
        except subprocess.TimeoutExpired:
            stop_group(proc)
            msg = f"\n[first_contact] stopped at its time share after {time.monotonic() - t0:.0f} s\n"
            if fh is not None:
                fh.write(msg)
            else:
                print(msg, flush=True)
            return None, time.monotonic() - t0
    finally:
        if fh is not None:
            fh.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of `proc`, then SIGKILL it if it is still there after the grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
