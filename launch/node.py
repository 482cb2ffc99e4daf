"""``pd-worker --node-rank R`` (R > 0): one node of an instance that spans nodes, without an API.

The node runs its ranks (`pd_cluster.engine.executor.node.NodeRanks`) and answers only ``GET /health`` on
``--host``/``--port`` (200 while its ranks run, 503 once they end), for the probes of its pod; every request goes to
node 0, which serves the instance. It exits 0 when rank 0 stops the instance, 1 with the reason when rank 0 goes
away or start-up fails (a node that did not join, a configuration that differs: the flag is named), and stops its
ranks on SIGTERM or SIGINT.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("pd.node")


def _health_server(host: str, port: int, ranks) -> ThreadingHTTPServer:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/health":
                return self._answer(404, {"error": {"message": "this node serves no API: send requests to node 0",
                                                    "type": "not_found_error", "code": 404}})
            ok = ranks.alive
            self._answer(200 if ok else 503, {"status": "ok" if ok else "ranks ended",
                                              "node_rank": ranks.config.parallel.node_rank})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # probes every few seconds: not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, daemon=True, name="node-health").start()
    return server


def serve_node(config) -> int:
    """Run node ``config.engine.parallel.node_rank`` (> 0) of its instance until it ends; the exit status."""
    from pd_cluster.engine.executor.node import NodeRanks
    from pd_cluster.engine.parallel.rendezvous import NodeJoinError
    from pd_cluster.transfer import ucx_env

    ucx_env.bind_to_host(config.host, config.transfer)  # this node's ranks' KV transfer agents listen here
    try:
        ranks = NodeRanks(config.engine)
    except (NodeJoinError, ValueError) as e:
        print(f"pd-worker: error: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = _health_server(config.host, config.port, ranks)
    try:
        error = ranks.wait(stop)
    finally:
        ranks.stop()
        server.shutdown()
    if error:
        print(f"pd-worker: error: {error}", file=sys.stderr)
        return 1
    logger.info("node %d: stopped", config.engine.parallel.node_rank)
    return 0
