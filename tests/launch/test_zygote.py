"""Workers forked from a zygote (`pd_cluster.launch.zygote`): each child runs its module as ``python -m`` would, in
its own session, with its own output pipe, and its exit is reported as `subprocess.Popen` reports it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pd_cluster.launch import zygote
from pd_cluster.launch.restarts import parent_bound_argv
from pd_cluster.launch.zygote import ForkedProcess, Zygote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]

CHILD_DIR = Path(__file__).resolve().parents[1] / "support"  # holds the `zygote_child` package


@pytest.fixture(scope="module")
def zyg():
    env = dict(os.environ, PYTHONUNBUFFERED="1", PD_ZYGOTE_TEST="one")
    z = Zygote(env, parent_bound_argv)
    yield z
    z.close()


def _child(z: Zygote, *args: str, **env: str) -> ForkedProcess:
    return z.spawn([sys.executable, "-m", "zygote_child", *args], dict(z.env, **env))


def test_a_child_runs_its_module_as_python_m_in_its_own_session(zyg, monkeypatch):
    monkeypatch.chdir(CHILD_DIR)  # `python -m` finds a module in the current directory; so must the child
    child = _child(zyg, "report", "a b", "c", CUDA_VISIBLE_DEVICES="3")
    lines = child.stdout.read().splitlines()
    assert child.wait(60) == 0 and child.poll() == 0 and child.returncode == 0
    got = json.loads(lines[0])
    assert lines[1:] == ["to stderr"]  # stderr shares the pipe, as Popen(stderr=STDOUT) gives
    assert got["argv"] == [str(CHILD_DIR / "zygote_child" / "__main__.py"), "report", "a b", "c"]
    assert got["name"] == "__main__" and got["cwd"] == str(CHILD_DIR) and got["stdin"] == ""
    assert got["pid"] == child.pid == got["pgid"] == got["sid"]  # os.killpg(child.pid) reaches it and its ranks
    assert got["ppid"] == zyg.proc.pid != os.getpid()
    assert got["preloaded"], "the worker's modules were imported again in the child"
    assert got["cuda_visible_devices"] == "3" and got["marker"] == "one"
    assert got["signals"] == [True, True, True, True]  # SIGINT, SIGTERM, SIGCHLD, SIGPIPE as a new interpreter's


def test_exit_codes_and_deaths_are_reported_as_popen_reports_them(zyg, monkeypatch):
    monkeypatch.chdir(CHILD_DIR)
    three = _child(zyg, "exit", "3")
    raised = _child(zyg, "raise")
    sleeper = _child(zyg, "sleep", "120")
    assert three.wait(60) == 3
    assert raised.wait(60) == 1 and "RuntimeError: raised in the child" in raised.stdout.read()
    assert sleeper.stdout.readline() == "up\n" and sleeper.poll() is None
    shown = " ".join(psutil.Process(sleeper.pid).cmdline()).split()
    assert shown == [sys.executable, "-m", "zygote_child", "sleep", "120"]  # what ps shows, as for a new interpreter
    assert psutil.Process(sleeper.pid).environ().get("PD_ZYGOTE_TEST") == "one"  # /proc/PID/environ left whole
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    os.killpg(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL
    sleeper.kill()  # after its exit: nothing to signal, no error


def test_only_a_matching_environment_and_a_module_command_are_forked(zyg):
    assert zyg.accepts(dict(zyg.env, CUDA_VISIBLE_DEVICES="0,1"))
    assert not zyg.accepts(dict(zyg.env, TRITON_INTERPRET="0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"))
    assert not zyg.accepts({k: v for k, v in zyg.env.items() if k != "PD_ZYGOTE_TEST"})
    with pytest.raises(ValueError, match="python -m"):
        zyg.spawn([sys.executable, "-c", "pass"], zyg.env)
    with pytest.raises(ValueError, match="environment"):
        zyg.spawn([sys.executable, "-m", "zygote_child", "exit", "0"], dict(zyg.env, PD_ZYGOTE_TEST="two"))
    assert zygote.spawn([sys.executable, "-c", "pass"], zyg.env, parent_bound_argv) is None


def test_children_die_with_their_zygote(monkeypatch):
    monkeypatch.chdir(CHILD_DIR)
    z = Zygote(dict(os.environ, PYTHONUNBUFFERED="1"), parent_bound_argv)
    try:
        child = _child(z, "sleep", "120")
        assert child.stdout.readline() == "up\n"
        os.kill(z.proc.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL  # what the launcher is told
        deadline = time.monotonic() + 10
        while psutil.pid_exists(child.pid) and psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child outlived its zygote"
            time.sleep(0.05)
        assert not z.alive
    finally:
        z.close()


def test_a_zygote_slow_to_preload_is_waited_for_while_its_cpu_time_advances(monkeypatch):
    """Slow is not dead: a zygote kept stopped 80% of the time for 8 s (it gets at most 1.6 s of CPU, less than
    its preload takes) answers a fork request that waited four times the stall bound, and stays in use."""
    monkeypatch.chdir(CHILD_DIR)
    monkeypatch.setattr(zygote, "STALL_S", 2.0)
    z = Zygote(dict(os.environ, PYTHONUNBUFFERED="1", PD_ZYGOTE_TEST="slow"), parent_bound_argv)
    stop = threading.Event()

    def throttle() -> None:
        until = time.monotonic() + 8.0
        while time.monotonic() < until and not stop.is_set():
            os.kill(z.proc.pid, signal.SIGSTOP)
            time.sleep(0.4)
            os.kill(z.proc.pid, signal.SIGCONT)
            time.sleep(0.1)

    throttler = threading.Thread(target=throttle, daemon=True)
    try:
        started = time.monotonic()
        throttler.start()
        child = _child(z, "report", "x")
        waited = time.monotonic() - started
        got = json.loads(child.stdout.readline())
        assert child.wait(60) == 0
        assert waited >= 4 * zygote.STALL_S, waited
        assert got["ppid"] == z.proc.pid and got["preloaded"] and got["marker"] == "slow"
        assert z.alive and z.proc.poll() is None
    finally:
        stop.set()
        throttler.join()
        os.kill(z.proc.pid, signal.SIGCONT)
        z.close()


def test_a_stopped_zygote_is_killed_after_the_stall_bound_and_the_worker_starts_anew(monkeypatch):
    """A zygote that makes no progress (SIGSTOPped before its preload) is given up once its CPU time has not
    advanced for `STALL_S`: `spawn` answers None (the launcher then starts the worker as a new interpreter) within
    the bound plus a poll, and the zygote is killed and forgotten."""
    monkeypatch.chdir(CHILD_DIR)
    monkeypatch.setattr(zygote, "_ZYGOTES", [])
    monkeypatch.setattr(zygote, "STALL_S", 2.0)
    made: list[Zygote] = []

    class StoppedAtBirth(Zygote):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            os.kill(self.proc.pid, signal.SIGSTOP)
            made.append(self)

    monkeypatch.setattr(zygote, "Zygote", StoppedAtBirth)
    started = time.monotonic()
    got = zygote.spawn([sys.executable, "-m", "zygote_child", "exit", "0"], dict(os.environ), parent_bound_argv)
    waited = time.monotonic() - started
    assert got is None
    assert zygote.STALL_S <= waited < zygote.STALL_S + 5, waited
    assert len(made) == 1 and zygote._ZYGOTES == [] and not made[0].alive
    assert made[0].proc.wait(10) == -signal.SIGKILL


def test_a_launcher_with_another_environment_gets_another_zygote_and_the_idle_one_ends(monkeypatch):
    monkeypatch.chdir(CHILD_DIR)
    monkeypatch.setattr(zygote, "_ZYGOTES", [])
    argv = [sys.executable, "-m", "zygote_child", "exit", "0"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = zygote.spawn(argv, env, parent_bound_argv)
    assert first is not None and first.wait(60) == 0
    again = zygote.spawn(argv, dict(env, CUDA_VISIBLE_DEVICES="1"), parent_bound_argv)
    assert again is not None and again.wait(60) == 0 and len(zygote._ZYGOTES) == 1
    old = zygote._ZYGOTES[0]
    other = zygote.spawn(argv, dict(env, PD_ZYGOTE_TEST="changed"), parent_bound_argv)
    try:
        assert other is not None and other.wait(60) == 0
        assert zygote._ZYGOTES != [old] and len(zygote._ZYGOTES) == 1 and old.proc.poll() is not None
    finally:
        for z in zygote._ZYGOTES:
            z.close()


def test_a_cluster_with_forked_workers_serves_exactly_and_restarts_a_killed_worker_forked(monkeypatch):
    """`ClusterSpec.fork_workers` end to end: a 1P1D `LocalCluster` whose workers are forked answers with the
    offline engine's greedy text, and a SIGKILLed decode worker, reported by its zygote, is forked again by `tend`
    and serves again."""
    import httpx
    from cluster_util import running_cluster

    from pd_cluster.engine import LLM, SamplingParams

    monkeypatch.setattr(zygote, "_ZYGOTES", [])
    prompt = "Once upon a time, there was a little"
    want = LLM().generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].text
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    try:
        with running_cluster(1, 1, fork_workers=True) as cluster:
            assert all(isinstance(p.popen, ForkedProcess) for p in cluster.procs)
            assert not isinstance(cluster.router.popen, ForkedProcess)  # the router starts anew
            ask = lambda: httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=60)  # noqa: E731
            assert ask().json()["choices"][0]["text"] == want
            decode = cluster.by_name("decode-0")
            old = decode.pid
            cluster.kill("decode-0")
            assert decode.popen.returncode == -signal.SIGKILL
            deadline = time.monotonic() + 60
            while decode.pid == old or not cluster._answers(decode):
                cluster.tend()
                assert time.monotonic() < deadline, "the killed decode was not started again within 60 s"
                time.sleep(0.2)
            assert isinstance(decode.popen, ForkedProcess) and decode.restarts.total == 1
            cluster.wait_ready(timeout=60)
            assert ask().json()["choices"][0]["text"] == want
    finally:
        for z in zygote._ZYGOTES:
            z.close()
