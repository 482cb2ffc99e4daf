"""A recording transport under the real ``kubernetes`` client: the client builds its real requests (URL, method,
headers, JSON body) and hands them to `RecordingPool` instead of urllib3's pool manager; the pool answers as a small
API server would for the objects the planner touches (StatefulSet scale, Pod, SelfSubjectAccessReview)."""

from __future__ import annotations

import io
import json
from urllib.parse import urlsplit

import urllib3
from kubernetes import client


class RecordingPool:
    """Answers the planner's calls; `requests` holds (method, path, headers, body as JSON) of each, in order.

    Args:
        replicas: each StatefulSet's replicas.
        pod_ips: each Pod's IP.
        denied: (verb, resource/subresource) pairs a SelfSubjectAccessReview answers not allowed.
    """

    def __init__(self, replicas: dict[str, int], pod_ips: dict[str, str] | None = None,
                 denied: set[tuple[str, str]] = frozenset()) -> None:
        self.replicas, self.pod_ips, self.denied = dict(replicas), dict(pod_ips or {}), set(denied)
        self.requests: list[tuple[str, str, dict, object]] = []

    def request(self, method, url, body=None, headers=None, **kw):
        path = urlsplit(url).path
        data = json.loads(body) if isinstance(body, (str, bytes)) and body else body
        self.requests.append((method, path, dict(headers or {}), data))
        parts = path.strip("/").split("/")
        if path.endswith("/selfsubjectaccessreviews"):
            attrs = data["spec"]["resourceAttributes"]
            res = attrs["resource"] + ("/" + attrs["subresource"] if attrs.get("subresource") else "")
            out = dict(data, status={"allowed": (attrs["verb"], res) not in self.denied})
            return self._answer(201, out)
        if parts[-1] == "scale" and parts[-3] == "statefulsets":
            name = parts[-2]
            if method == "PATCH":
                self.replicas[name] = data["spec"]["replicas"]
            n = self.replicas[name]
            return self._answer(200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                                      "metadata": {"name": name, "namespace": parts[3]},
                                      "spec": {"replicas": n}, "status": {"replicas": n}})
        if parts[-2] == "pods":
            name = parts[-1]
            return self._answer(200, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                      "status": {"podIP": self.pod_ips.get(name)}})
        return self._answer(404, {"kind": "Status", "code": 404})

    @staticmethod
    def _answer(status: int, obj: dict):
        return urllib3.HTTPResponse(body=io.BytesIO(json.dumps(obj).encode()), status=status,
                                    headers={"Content-Type": "application/json"}, preload_content=False)


def api_client(pool: RecordingPool) -> client.ApiClient:
    """A real `ApiClient` whose REST client sends through `pool`."""
    config = client.Configuration(host="https://kube.test")
    api = client.ApiClient(config)
    api.rest_client.pool_manager = pool
    return api
