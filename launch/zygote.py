"""Worker processes forked from a zygote that imported the worker's code once.

A worker spends most of its start-up importing: torch, transformers (with the tokenizer's configuration chain,
which pulls in ``torch.distributed.tensor``), FastAPI and the engine took 3 to 6 s of CPU per worker on a
2-core machine, against well under a second for the rest of its start. A launcher that starts or restarts many
workers pays that each time. Android's zygote and multiprocessing's forkserver answer the same cost the same
way: one process imports once, then forks a child per command.

`Zygote` is the launcher's handle on that process (whose code is `pd_cluster.launch.zygote_process`) for
`LocalCluster` (``pd-serve``). It is started like any child of the launcher (bound
to it by ``PR_SET_PDEATHSIG``), imports `PRELOAD`, and waits on a Unix socket. For each command it forks; the
child starts a new session (``setsid``: its process group is its own, as with ``start_new_session``), asks for
``PR_SET_PDEATHSIG`` against the zygote, puts the launcher's pipe on its stdout and stderr, and runs the
command's module as ``python -m`` would. The zygote reaps its children and reports each exit status, so a
`ForkedProcess` answers ``poll``/``wait``/``returncode`` as a `subprocess.Popen` does.

A fork request waits for as long as the zygote makes progress: the first one waits for the preload, which takes
3.5 s of CPU on an idle 2-core machine and minutes under CPU starvation. A zygote whose CPU time stops advancing
for `STALL_S` (stopped, or blocked) is killed, and the launcher starts that worker as a new interpreter and the
next ones from a new zygote.

What a fork cannot change, the zygote is chosen by: a child's environment must equal its zygote's but for
`PER_CHILD_ENV` (libraries read the environment when they are imported; Triton reads ``TRITON_INTERPRET`` when a
kernel is decorated, which is why no kernel module is preloaded: a worker decides that after it starts). A
launcher whose environment changed gets another zygote. Nothing preloaded initialises CUDA, so each child
still chooses its devices (``CUDA_VISIBLE_DEVICES``) itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from queue import Empty, Queue

from pd_cluster.common.process import cpu_ticks
from pd_cluster.launch.zygote_process import MAX_MESSAGE, PRELOAD, TITLE_ROOM

__all__ = ["PRELOAD", "ForkedProcess", "Zygote", "spawn", "STALL_S"]

# The only environment entries a child may have different from its zygote's (set after the fork).
PER_CHILD_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})
# A fork request waits as long as the zygote makes progress: the first one waits for its preload, which took over
# 120 s under CPU starvation (12 busy loops on 2 cores). It gives up once the zygote's CPU time has not advanced for
# this long: it is stopped or stuck, not slow ("slow is not dead").
STALL_S = 30.0
_POLL_S = 0.5


class ForkedProcess:
    """A child of a `Zygote`, with the part of `subprocess.Popen`'s interface a launcher uses.

    Attributes:
        pid: the child's process id; it leads its own session and process group.
        stdout: text stream of the child's stdout and stderr, as ``Popen(stdout=PIPE, stderr=STDOUT, text=True,
            errors="replace")`` gives.
        returncode: None while it runs, then its exit code (``-N`` for death by signal N), as Popen's.
    """

    def __init__(self, pid: int, args: list[str], stdout) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the child has exited. Raises `subprocess.TimeoutExpired` after `timeout` s."""
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's side of one zygote process: forks commands, tracks their exits.

    Spawn from one long-lived thread (the launcher's spawner thread): the zygote gets ``PR_SET_PDEATHSIG`` against
    the thread that forked it.
    """

    def __init__(self, env: dict[str, str], bind_to_parent) -> None:
        """`env`: the zygote's environment (every child shares it but for `PER_CHILD_ENV`); `bind_to_parent`:
        wraps an argv so that the child dies with this process (`pd_cluster.launch.restarts.parent_bound_argv`)."""
        self.env = dict(env)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = bind_to_parent([sys.executable, "-c", "from pd_cluster.launch.zygote_process import serve; serve()",
                               str(theirs.fileno()), " " * TITLE_ROOM])
        self.proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                     start_new_session=True)
        theirs.close()
        self._sock = mine
        self._children: dict[int, ForkedProcess] = {}
        self._replies: Queue = Queue()
        self._lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._read, name="pd-zygote-reader", daemon=True).start()

    def accepts(self, env: dict[str, str]) -> bool:
        """True when a child with `env` can be forked from this zygote."""
        differs = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return self.alive and differs <= PER_CHILD_ENV

    def busy(self) -> bool:
        """True while a child of this zygote runs."""
        return any(c.returncode is None for c in list(self._children.values()))

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """Fork ``argv`` = ``[sys.executable, "-m", MODULE, *ARGS]`` with `env` (see `accepts`).

        Raises:
            ValueError: `argv` is not of that form, `env` is not accepted, or this process has no working
                directory (it was removed).
            RuntimeError: the zygote is gone, or made no progress (its CPU time did not advance) for `STALL_S`
                before it answered; it is then killed.
        """
        if not _runs_a_module(argv):
            raise ValueError(f"a zygote runs `python -m MODULE`, not {argv[:3]}")
        if not self.accepts(env):
            raise ValueError("the environment differs from the zygote's")
        try:
            cwd = os.getcwd()
        except OSError as e:  # the launcher's directory was removed: only a new interpreter can start there
            raise ValueError(f"no working directory: {e}") from e
        read_end, write_end = os.pipe()
        request = {"module": argv[2], "argv": argv, "cwd": cwd, "env": {k: env.get(k) for k in PER_CHILD_ENV}}
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [write_end])
                reply = self._reply()
            except (OSError, RuntimeError) as e:
                os.close(read_end)
                self.alive = False
                self.proc.kill()
                raise RuntimeError(f"the worker zygote did not fork: {e!r}") from e
            finally:
                os.close(write_end)
        if isinstance(reply, str):
            os.close(read_end)
            raise RuntimeError(f"the worker zygote did not fork: {reply}")
        reply.stdout = os.fdopen(read_end, "r", errors="replace")
        reply.args = argv
        return reply

    def _reply(self) -> ForkedProcess | str:
        """The zygote's answer to the request just sent, waited for while the zygote makes progress.

        Raises:
            RuntimeError: it exited, or its CPU time did not advance for `STALL_S`.
        """
        last, since = cpu_ticks(self.proc.pid), time.monotonic()
        while True:
            try:
                return self._replies.get(timeout=_POLL_S)
            except Empty:
                pass
            if self.proc.poll() is not None or not self.alive:
                raise RuntimeError(f"the zygote exited ({self.proc.returncode})")
            now, ticks = time.monotonic(), cpu_ticks(self.proc.pid)
            if ticks != last:
                last, since = ticks, now
            elif now - since >= STALL_S:
                raise RuntimeError(f"the zygote made no progress for {STALL_S:.0f} s")

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "pid" in msg:
                child = ForkedProcess(msg["pid"], [], None)
                self._children[child.pid] = child
                self._replies.put(child)
            elif "exit" in msg:
                child = self._children.get(msg["exit"])
                if child is not None:
                    child._set_exit(msg["code"])
            else:
                self._replies.put(str(msg.get("error")))
        self.alive = False  # its children die with it (PR_SET_PDEATHSIG)
        for child in self._children.values():
            child._set_exit(-signal.SIGKILL)

    def close(self) -> None:
        """End the zygote (and, by their parent-death signal, any child still running)."""
        self.alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # an EOF for the zygote, though our reader still waits in recv
            self._sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _runs_a_module(argv: list[str]) -> bool:
    """True for ``[sys.executable, "-m", MODULE, *ARGS]``, the one form of command a zygote forks."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"


_ZYGOTES: list[Zygote] = []  # used only from the launcher's spawner thread


def spawn(argv: list[str], env: dict[str, str], bind_to_parent) -> ForkedProcess | None:
    """Fork `argv` from a zygote of `env` (started on first use, kept for the next), or None when it cannot be
    (another form of command, a zygote that failed): the caller then starts the command itself.

    Call from one long-lived thread (see `Zygote`). A zygote whose environment no longer matches the launcher's is
    closed once none of its children runs.
    """
    if not _runs_a_module(argv):
        return None
    zygote = next((z for z in _ZYGOTES if z.accepts(env)), None)
    if zygote is None:
        for old in [z for z in _ZYGOTES if not z.busy()]:
            _ZYGOTES.remove(old)
            old.close()
        zygote = Zygote({k: v for k, v in env.items() if k not in PER_CHILD_ENV}, bind_to_parent)
        _ZYGOTES.append(zygote)
    try:
        return zygote.spawn(argv, env)
    except ValueError:  # this command cannot be forked; the zygote is fine
        return None
    except RuntimeError as e:
        print(f"pd-serve: starting {argv[2]} without the zygote ({e})", file=sys.stderr, flush=True)
        _ZYGOTES.remove(zygote)
        zygote.close()
        return None
