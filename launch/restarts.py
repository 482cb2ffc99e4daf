"""Restarting dead cluster processes: an explicit exponential backoff, and children bound to their launcher.

`RestartBackoff` decides when a process that exited is started again: the n-th restart in a row waits
``min(max_delay, initial_delay * factor**(n-1))`` seconds; a process that stayed up `stable_after` seconds
starts the count again; after `max_restarts` restarts in a row it is given up. This is the policy of
Kubernetes' ``CrashLoopBackOff`` (10 s doubling to 5 min, reset after 10 min of running) with shorter
numbers for one machine. The policy is small and non-blocking (the supervision loop asks it at each tick), so
a retry library such as tenacity, built around retrying one blocking call, does not fit here.

`parent_bound_argv` makes a child die with its launcher however the launcher dies (SIGKILL, the OOM killer,
a CI timeout): on Linux the child asks the kernel for ``PR_SET_PDEATHSIG`` (prctl(2)) before it execs the
real command. The request is made in a tiny Python preamble rather than in a ``preexec_fn``, which is unsafe
in a process with threads (ours copy the children's output). The kernel sends the signal when the *thread*
that forked the child exits, so a launcher forks its children from one thread that lives as long as it does.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

# Run in the child before the real command: default SIGINT/SIGTERM handling and an empty signal mask (a Ray
# worker ignores or blocks some signals, and both survive exec), the parent-death signal, a check that the
# parent is still the launcher (it may have died before the prctl), then exec.
# argv of the preamble: PARENT_PID SIGNAL EXECUTABLE ARGS...
_EXEC_PREAMBLE = ("import ctypes, os, signal, sys; "
                  "[signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM)]; "
                  "signal.pthread_sigmask(signal.SIG_SETMASK, []); "
                  "sys.platform.startswith('linux') and ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2])); "
                  "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
                  "os.execv(sys.argv[3], sys.argv[3:])")


def parent_bound_argv(argv: list[str], sig: int = signal.SIGKILL, parent_pid: int | None = None) -> list[str]:
    """`argv` (executable first) wrapped so that the child gets `sig` when its parent dies.

    Args:
        sig: the parent-death signal (SIGKILL: the launcher is gone, nothing is left to drain for).
        parent_pid: the process that spawns the child (default: this one).
    """
    return [sys.executable, "-c", _EXEC_PREAMBLE, str(parent_pid or os.getpid()), str(int(sig)), *argv]


@dataclass(frozen=True)
class RestartBackoff:
    """When to restart a process that exited.

    Attributes:
        initial_delay: seconds before the first restart in a row.
        factor: each further restart in a row waits this many times longer.
        max_delay: the longest wait, in seconds.
        stable_after: seconds of running after which the count of restarts in a row starts again.
        max_restarts: restarts in a row before the process is given up; -1: never give up.
    """

    initial_delay: float = 1.0
    factor: float = 2.0
    max_delay: float = 30.0
    stable_after: float = 60.0
    max_restarts: int = 10

    def __post_init__(self) -> None:
        if self.initial_delay < 0 or self.factor < 1 or self.max_delay < self.initial_delay:
            raise ValueError(f"bad backoff: {self}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}")

    def delay(self, attempt: int) -> float:
        """Seconds before restart number `attempt` (1-based) in a row."""
        return min(self.max_delay, self.initial_delay * self.factor ** (attempt - 1))


@dataclass
class RestartState:
    """One process's restart bookkeeping (owned by the launcher's supervision loop).

    Attributes:
        started_at: monotonic time of the last start.
        in_a_row: restarts since the process last ran for `stable_after` seconds.
        total: restarts since the cluster started.
        due: monotonic time of the planned restart; None when none is planned.
        given_up: no more restarts.
        awaiting_health: restarted, not yet answering ``/health``.
    """

    started_at: float = 0.0
    in_a_row: int = 0
    total: int = 0
    due: float | None = None
    given_up: bool = False
    awaiting_health: bool = False

    def on_exit(self, policy: RestartBackoff, now: float) -> float | None:
        """Plan a restart after an exit seen at `now`: returns its delay in seconds, or None (given up)."""
        if now - self.started_at >= policy.stable_after:
            self.in_a_row = 0
        if policy.max_restarts >= 0 and self.in_a_row >= policy.max_restarts:
            self.given_up, self.due = True, None
            return None
        self.in_a_row += 1
        delay = policy.delay(self.in_a_row)
        self.due = now + delay
        return delay

    def on_restart(self, now: float) -> None:
        """The planned restart happened at `now`."""
        self.started_at, self.due = now, None
        self.total += 1
        self.awaiting_health = True
