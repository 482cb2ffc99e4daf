"""Run by `tests/launch/test_zygote.py` as ``python -m zygote_child ACTION [ARGS]`` from a worker zygote."""

import json
import os
import signal
import sys
import time

preloaded = "torch" in sys.modules and "pd_cluster.launch.worker" in sys.modules  # before this module imports any
action = sys.argv[1]
if action == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "pid": os.getpid(),
                      "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "preloaded": preloaded,
                      "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "marker": os.environ.get("PD_ZYGOTE_TEST"), "stdin": sys.stdin.read(),
                      "signals": [signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                                  signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                                  signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
                                  signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN]}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
elif action == "exit":
    sys.exit(int(sys.argv[2]))
elif action == "raise":
    raise RuntimeError("raised in the child")
elif action == "sleep":
    print("up", flush=True)
    time.sleep(float(sys.argv[2]))
