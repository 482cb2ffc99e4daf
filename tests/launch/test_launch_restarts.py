"""The restart backoff and the parent-death binding of `pd_cluster.launch.restarts`, without a cluster."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from pd_cluster.launch.restarts import RestartBackoff, RestartState, parent_bound_argv


def test_backoff_doubles_to_its_cap():
    b = RestartBackoff(initial_delay=1.0, factor=2.0, max_delay=30.0)
    assert [b.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    with pytest.raises(ValueError):
        RestartBackoff(initial_delay=5.0, max_delay=1.0)
    with pytest.raises(ValueError):
        RestartBackoff(max_restarts=-2)


def test_restart_state_counts_restarts_in_a_row_and_gives_up():
    b = RestartBackoff(initial_delay=1.0, max_delay=8.0, stable_after=60.0, max_restarts=3)
    s = RestartState(started_at=0.0)
    delays = []
    now = 10.0
    for _ in range(3):  # crashes 10 s after each start: not stable
        delays.append(s.on_exit(b, now))
        due = s.due
        assert due == now + delays[-1]
        s.on_restart(due)
        assert s.awaiting_health and s.due is None
        now = due + 10.0
    assert delays == [1.0, 2.0, 4.0] and s.total == 3
    assert s.on_exit(b, now) is None and s.given_up and s.due is None


def test_a_stable_run_starts_the_count_again():
    b = RestartBackoff(initial_delay=1.0, stable_after=60.0, max_restarts=2)
    s = RestartState(started_at=0.0)
    assert s.on_exit(b, 5.0) == 1.0
    s.on_restart(6.0)
    assert s.on_exit(b, 7.0) == 2.0
    s.on_restart(9.0)
    assert s.on_exit(b, 100.0) == 1.0  # ran 91 s: the crash loop was over


def test_no_restarts_with_max_restarts_zero():
    s = RestartState()
    assert s.on_exit(RestartBackoff(max_restarts=0), 100.0) is None and s.given_up


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_a_parent_bound_child_dies_with_its_parent():
    """A middle process spawns a parent-bound sleeper and is SIGKILLed: the sleeper goes within 5 s."""
    middle_code = (
        "import subprocess, sys, time\n"
        "from pd_cluster.launch.restarts import parent_bound_argv\n"
        "child = subprocess.Popen(parent_bound_argv([sys.executable, '-c', 'import time; time.sleep(120)']),"
        " start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n")
    middle = subprocess.Popen([sys.executable, "-c", middle_code], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    try:
        deadline = time.monotonic() + 20  # the preamble execs the real command
        while psutil.Process(child).cmdline()[-1] != "import time; time.sleep(120)":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        middle.send_signal(signal.SIGKILL)
        middle.wait(10)
        deadline = time.monotonic() + 5
        while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        if middle.poll() is None:
            middle.kill()
        try:
            psutil.Process(child).kill()
        except psutil.NoSuchProcess:
            pass


def test_parent_bound_argv_wraps_the_command():
    argv = parent_bound_argv(["/bin/echo", "hi"], signal.SIGINT, parent_pid=42)
    assert argv[0] == sys.executable and argv[3:] == ["42", str(int(signal.SIGINT)), "/bin/echo", "hi"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_a_child_started_from_a_short_lived_thread_outlives_that_thread():
    """The parent-death signal follows the forking *thread*: `LocalCluster` forks from one lasting thread, so a
    restart called from ``asyncio.to_thread`` or a pool does not die when that thread ends."""
    import threading

    from pd_cluster.launch.cluster import ClusterSpec, LocalCluster, Proc

    cluster = LocalCluster(ClusterSpec(num_prefill=0, num_decode=0, echo=False))
    proc = Proc("sleeper", "mixed", "", [sys.executable, "-c", "import time; time.sleep(60)"])
    def spawn_then_end() -> None:
        cluster._spawn(proc)
        time.sleep(2.0)  # let the child's preamble run its prctl while this thread still lives

    t = threading.Thread(target=spawn_then_end)
    t.start()
    t.join()
    try:
        time.sleep(1.0)  # this thread ended a second ago
        assert proc.alive() and psutil.Process(proc.pid).cmdline()[-1] == "import time; time.sleep(60)"
    finally:
        proc.popen.kill()
        proc.popen.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_second_stop_signal_kills_what_the_drain_still_waits_for():
    """`LocalCluster.stop`'s wait: a child that ignores SIGTERM (a drain that takes long) is waited for until its
    timeout, unless `force` is set (pd-serve's second Ctrl-C): then it is SIGKILLed at once."""
    import threading

    from pd_cluster.launch.cluster import Proc, signal_all, wait_or_kill

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    p = Proc("slow-drain", "router", "http://unused", [])
    p.popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    assert p.popen.stdout.readline() == "up\n"
    signal_all([p], signal.SIGTERM)
    force = threading.Event()
    threading.Timer(0.5, force.set).start()
    said: list[str] = []
    started = time.monotonic()
    wait_or_kill([p], 30.0, force, said.append)
    assert time.monotonic() - started < 5  # not the 30 s timeout
    assert p.popen.returncode == -signal.SIGKILL and said == ["killing slow-drain (still running after the drain)"]
