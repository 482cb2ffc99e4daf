"""A loopback Kubernetes API server for pods: real-format ``v1.PodList`` and watch events.

It serves ``GET /api/v1/namespaces/{ns}/pods`` (list, and ``watch=true`` streams
of ``ADDED``/``MODIFIED``/``DELETED`` events as JSON lines) with resource
versions, label selectors and ``timeoutSeconds``; a watch from a version older
than the last compaction gets an ``ERROR`` event carrying a 410 ``Status``, as
the real API server sends. The test drives the cluster state through
:meth:`put_pod`, :meth:`delete_pod`, :meth:`compact` and :meth:`end_watches`.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


def pod_json(name: str, namespace: str, rv: int, labels: dict, ip: str | None, ready: bool,
             annotations: dict | None = None, terminating: bool = False) -> dict:
    meta = {"name": name, "namespace": namespace, "uid": f"uid-{name}",
            "resourceVersion": str(rv), "labels": labels, "annotations": annotations or {},
            "creationTimestamp": "2026-11-20T00:00:00Z"}
    if terminating:
        meta["deletionTimestamp"] = "2026-11-20T00:10:00Z"
    conditions = [{"type": "Initialized", "status": "True"},
                  {"type": "ContainersReady", "status": "True" if ready else "False"},
                  {"type": "Ready", "status": "True" if ready else "False"}]
    status = {"phase": "Running" if ip else "Pending", "conditions": conditions}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "worker", "image": "pd-cluster:test"}]},
            "status": status}


def _matches(pod: dict, selector: str) -> bool:
    labels = pod["metadata"]["labels"]
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKubeApi:
    """Cluster state plus the HTTP server; use as a context manager."""

    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.rv = 100
        self.min_rv = 0
        self.pods: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.requests: list[dict] = []
        self.cond = threading.Condition()
        self.generation = 0  # bumped to end every open watch
        self.compactions = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeKubeApi":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.end_watches()
        self.server.shutdown()
        self.server.server_close()

    # cluster state -----------------------------------------------------------------------
    def put_pod(self, name: str, labels: dict, ip: str | None, ready: bool,
                annotations: dict | None = None, terminating: bool = False,
                notify: bool = True) -> None:
        """Create or update a pod; ``notify=False`` changes state without a watch event."""
        with self.cond:
            self.rv += 1
            kind = "MODIFIED" if name in self.pods else "ADDED"
            pod = pod_json(name, self.namespace, self.rv, labels, ip, ready, annotations, terminating)
            self.pods[name] = pod
            if notify:
                self.events.append((self.rv, kind, pod))
            self.cond.notify_all()

    def delete_pod(self, name: str, notify: bool = True) -> None:
        with self.cond:
            self.rv += 1
            pod = self.pods.pop(name)
            pod = json.loads(json.dumps(pod))
            pod["metadata"]["resourceVersion"] = str(self.rv)
            if notify:
                self.events.append((self.rv, "DELETED", pod))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget history: open watches get ERROR 410, and so do watches from old versions."""
        with self.cond:
            self.min_rv = self.rv
            self.compactions += 1
            self.events.clear()
            self.cond.notify_all()

    def end_watches(self) -> None:
        """End every open watch normally, as the server's watch timeout does."""
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def watch_requests(self) -> list[dict]:
        return [r for r in self.requests if r.get("watch") == "true"]

    def list_requests(self) -> list[dict]:
        return [r for r in self.requests if r.get("watch") != "true"]

    # HTTP ----------------------------------------------------------------------------------
    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                if parts.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    self.send_error(404)
                    return
                q = {k: v[0] for k, v in parse_qs(parts.query).items()}
                api.requests.append(q)
                if q.get("watch") == "true":
                    api._watch(self, q)
                else:
                    api._list(self, q.get("labelSelector", ""))

        return Handler

    def _list(self, h: BaseHTTPRequestHandler, selector: str) -> None:
        with self.cond:
            items = [p for p in self.pods.values() if _matches(p, selector)]
            body = {"kind": "PodList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.rv)}, "items": items}
        data = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _watch(self, h: BaseHTTPRequestHandler, q: dict) -> None:
        selector = q.get("labelSelector", "")
        since = int(q.get("resourceVersion") or self.rv)
        deadline = time.monotonic() + float(q.get("timeoutSeconds", 300))
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("transfer-encoding", "chunked")  # as the API server streams watches
        h.send_header("connection", "close")
        h.end_headers()
        try:
            self._stream_events(h, selector, since, deadline)
        finally:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()

    def _stream_events(self, h: BaseHTTPRequestHandler, selector: str, since: int,
                       deadline: float) -> None:
        with self.cond:
            generation, compactions = self.generation, self.compactions
            while True:
                if since < self.min_rv or self.compactions != compactions:
                    self._send(h, {"type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": f"too old resource version: {since} ({self.min_rv})",
                        "reason": "Expired", "code": 410}})
                    return
                for rv, kind, pod in self.events:
                    if rv > since and _matches(pod, selector):
                        self._send(h, {"type": kind, "object": pod})
                since = self.rv
                left = deadline - time.monotonic()
                if left <= 0 or self.generation != generation:
                    return
                self.cond.wait(min(left, 0.5))

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, event: dict) -> None:
        line = json.dumps(event).encode() + b"\n"
        h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        h.wfile.flush()
