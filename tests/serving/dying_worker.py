"""A `pd-worker` whose engine raises after a number of steps: for the engine-death test only.

Usage: ``python dying_worker.py STEPS pd-worker flags...``. The failure is injected by replacing the engine's
``step`` in this process before serving; nothing of it is reachable over HTTP.
"""

from __future__ import annotations

import sys

import uvicorn

from pd_cluster.launch.worker import build_app, build_parser, worker_config_from_args


def main() -> int:
    steps_before_failure = int(sys.argv[1])
    args = build_parser().parse_args(sys.argv[2:])
    app = build_app(worker_config_from_args(args))
    engine = app.state.worker.loop.engine
    real_step = engine.step
    count = [0]

    def step():
        count[0] += 1
        if count[0] > steps_before_failure:
            raise RuntimeError("injected engine failure")
        return real_step()

    engine.step = step
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0  # not reached when the engine dies: the worker exits with its own status


if __name__ == "__main__":
    sys.exit(main())
