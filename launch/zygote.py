"""Worker processes forked from a zygote that imported the worker's code once.

A worker spends most of its start-up importing: torch, transformers (with the tokenizer's configuration chain,
which pulls in ``torch.distributed.tensor``), FastAPI and the engine took 3 to 6 s of CPU per worker on a
2-core machine, against well under a second for the rest of its start. A launcher that starts or restarts many
workers pays that each time. Android's zygote and multiprocessing's forkserver answer the same cost the same
way: one process imports once, then forks a child per command.

`Zygote` is that process for `LocalCluster` (``pd-serve``). It is started like any child of the launcher (bound
to it by ``PR_SET_PDEATHSIG``), imports `PRELOAD`, and waits on a Unix socket. For each command it forks; the
child starts a new session (``setsid``: its process group is its own, as with ``start_new_session``), asks for
``PR_SET_PDEATHSIG`` against the zygote, puts the launcher's pipe on its stdout and stderr, and runs the
command's module as ``python -m`` would. The zygote reaps its children and reports each exit status, so a
`ForkedProcess` answers ``poll``/``wait``/``returncode`` as a `subprocess.Popen` does.

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
from queue import Empty, Queue

from pd_cluster.common.process import exit_now

# Imported once by the zygote. No kernel module (see the module docstring), and nothing that asks torch.cuda about
# the device at import (xgrammar does: `tests/engine/test_rank_procs.py` checks the list).
PRELOAD = ("pd_cluster.launch.worker", "torch.distributed.tensor", "transformers.models.llama.configuration_llama",
           "transformers.models.auto.tokenization_auto", "nixl._api")
# The only environment entries a child may have different from its zygote's (set after the fork).
PER_CHILD_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})
_MAX_MESSAGE = 1 << 20
_SPAWN_TIMEOUT_S = 120.0  # the first fork waits for the preload
_PR_SET_PDEATHSIG = 1
# Blank room at the end of the zygote's command line: a child writes its own command there (`_set_title`), which
# shows in ps; a longer one is cut. The environment's memory, which follows, is left as it is.
_TITLE_ROOM = 4096


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
        argv = bind_to_parent([sys.executable, "-c", "from pd_cluster.launch.zygote import serve; serve()",
                               str(theirs.fileno()), " " * _TITLE_ROOM])
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
            RuntimeError: the zygote did not answer within `_SPAWN_TIMEOUT_S` or is gone.
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
                reply = self._replies.get(timeout=_SPAWN_TIMEOUT_S)
            except (OSError, Empty) as e:
                os.close(read_end)
                self.alive = False
                raise RuntimeError(f"the worker zygote did not fork: {e!r}") from e
            finally:
                os.close(write_end)
        if isinstance(reply, str):
            os.close(read_end)
            raise RuntimeError(f"the worker zygote did not fork: {reply}")
        reply.stdout = os.fdopen(read_end, "r", errors="replace")
        reply.args = argv
        return reply

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
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


# ---- the zygote process ----------------------------------------------------------------------------------------
def serve() -> None:
    """The zygote's main loop (``argv[1]``: its socket's file descriptor). Single-threaded, so a fork is safe."""
    import importlib
    import selectors

    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a child imports what it needs itself
            pass
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _report_exits(sock)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
            except OSError:
                data, fds = b"", []
            if not data:  # the launcher is gone
                os._exit(0)
            request = json.loads(data)
            try:
                pid = _fork(request, fds[0], closing=(sock.fileno(), wake_r, wake_w, sel))
                reply = {"pid": pid}
            except OSError as e:
                reply = {"error": repr(e)}
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                sock.send(json.dumps(reply).encode())
            except OSError:  # the launcher is gone
                os._exit(0)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:  # the launcher is gone
            os._exit(0)


def _fork(request: dict, out_fd: int, closing: tuple) -> int:
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the zygote died before the prctl
            os._exit(1)
        *fds, sel = closing
        sel.close()
        signal.set_wakeup_fd(-1)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # as a new interpreter has them
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(devnull)
        os.close(out_fd)
        for key, value in request["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _set_title(request["argv"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]
        sys.argv = [request["argv"][0], *request["argv"][3:]]
        code = _run_as_main(request["module"])
    except BaseException:  # the child never returns into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        exit_now(code)


def _set_title(argv: list[str]) -> None:
    """Show the command the child runs in ``ps`` and ``/proc/PID/cmdline`` (where the zygote's own would be), in
    the room of the zygote's command line only (``SPT_NOENV``): ``/proc/PID/environ`` stays the environment the
    child has."""
    try:
        os.environ["SPT_NOENV"] = "1"
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))
    except ImportError:
        pass
    finally:
        os.environ.pop("SPT_NOENV", None)


def _run_as_main(module: str) -> int:
    """Run `module` as ``python -m`` does and end as the interpreter would; returns the exit code."""
    import atexit
    import runpy

    try:
        runpy._run_module_as_main(module, alter_argv=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as the interpreter ends then: by the signal
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    threading._shutdown()  # what interpreter exit does: wait for non-daemon threads, then run atexit
    atexit._run_exitfuncs()
    return code

