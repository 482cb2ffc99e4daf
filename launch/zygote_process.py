"""The zygote process of `pd_cluster.launch.zygote`: it imports `PRELOAD` once, then forks a child per request.

Its Python code is single-threaded. The one other thread it has, OpenBLAS's pool (numpy's import starts it), is
shut down before each fork by OpenBLAS's own ``pthread_atfork`` handler, so a child starts with no lock held by a
thread it does not have. The launcher's side, the protocol and what a child gets: `pd_cluster.launch.zygote`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

from pd_cluster.common.process import exit_now

# Imported once by the zygote. No kernel module (see `pd_cluster.launch.zygote`), and nothing that asks torch.cuda
# about the device at import (xgrammar does: `tests/engine/test_rank_procs.py` checks the list).
PRELOAD = ("pd_cluster.launch.worker", "torch.distributed.tensor", "transformers.models.llama.configuration_llama",
           "transformers.models.auto.tokenization_auto", "nixl._api")
MAX_MESSAGE = 1 << 20
"""Bytes of one message on the zygote's socket at most."""
# Blank room at the end of the zygote's command line: a child writes its own command there (`_set_title`), which
# shows in ps; a longer one is cut. The environment's memory, which follows, is left as it is.
TITLE_ROOM = 4096
_PR_SET_PDEATHSIG = 1


def serve() -> None:
    """The zygote's main loop (``argv[1]``: its socket's file descriptor; see the module docstring)."""
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
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
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

