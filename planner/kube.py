"""The Kubernetes connector: the planner scales the prefill and decode StatefulSets through the API server.

``pd-planner --connector kubernetes --namespace NS --prefill-workload STS --decode-workload STS`` (the chart's
planner Deployment passes them). It uses the official ``kubernetes`` client (in-cluster config, else the
kubeconfig) and needs exactly these permissions in its namespace (`REQUIRED`), which the chart's planner Role
grants: ``get`` and ``patch`` on ``statefulsets/scale`` (apps) and ``get`` on ``pods``. At start-up it asks the
API server (``SelfSubjectAccessReview``) whether it has them, and refuses to start, naming ``--connector``,
when it does not.

Actions (`pd_cluster.planner.actions.ActionConnector` picks them): **up**: patch the role's ``scale``
subresource to ``replicas + 1``, then wait until the router (which discovers the pods itself) lists one more
healthy worker of the role. **down**: a StatefulSet removes its highest ordinal first, so that pod is the one
drained: its IP is read from its Pod, the router is told to drain the worker at that IP
(``POST /workers/{id}/drain``), its ``/get_load`` must show nothing left and every page free, and only then is
``replicas - 1`` patched; the router's discovery removes the pod once it terminates. The router refuses to
switch the role of a discovered worker (its labels give its role), so at ``--max-workers`` a switch is a drain
of one role followed by a start of the other.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from pd_cluster.planner.actions import ActionConnector, ActionFailed, RouterAdmin
from pd_cluster.planner.runner import PlannerMetrics
from pd_cluster.planner.scrape import ClusterView

REQUIRED = (("apps", "statefulsets", "scale", "get"), ("apps", "statefulsets", "scale", "patch"),
            ("", "pods", "", "get"))
"""(API group, resource, subresource, verb) the connector needs in its namespace."""


def describe(rule: tuple[str, str, str, str]) -> str:
    group, resource, sub, verb = rule
    return f"{verb} {resource}{'/' + sub if sub else ''}{' (' + group + ')' if group else ''}"


class KubernetesConnector(ActionConnector):
    """Scales the role StatefulSets (module docstring).

    Args:
        admin: the router's admin API.
        namespace: where the workloads are.
        workloads: each role's StatefulSet name (``{"prefill": "pd-pd-cluster-prefill", ...}``).
        api_client: a ``kubernetes.client.ApiClient`` (default: in-cluster config, else the kubeconfig).
    """

    name = "kubernetes"

    def __init__(self, admin: RouterAdmin, namespace: str, workloads: dict[str, str], api_client=None,
                 metrics: PlannerMetrics | None = None, **kw) -> None:
        super().__init__(admin, metrics, **kw)
        from kubernetes import client

        if api_client is None:
            from kubernetes import config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.namespace, self.workloads = namespace, dict(workloads)
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.authz = client.AuthorizationV1Api(api_client)
        self._client = client
        self.poll_s = 1.0  # how often a start looks at the pod and the router

    def missing_permissions(self) -> list[str]:
        """The `REQUIRED` permissions the API server denies this identity (``SelfSubjectAccessReview``)."""
        c = self._client
        out = []
        for group, resource, sub, verb in REQUIRED:
            review = c.V1SelfSubjectAccessReview(spec=c.V1SelfSubjectAccessReviewSpec(
                resource_attributes=c.V1ResourceAttributes(namespace=self.namespace, group=group, resource=resource,
                                                           subresource=sub or None, verb=verb)))
            answer = self.authz.create_self_subject_access_review(review)
            if not (answer.status and answer.status.allowed):
                out.append(describe((group, resource, sub, verb)))
        return out

    def replicas(self, role: str) -> int:
        return int(self.apps.read_namespaced_stateful_set_scale(self.workloads[role], self.namespace).spec.replicas or 0)

    def scale(self, role: str, replicas: int) -> None:
        """Patch the role's ``scale`` subresource's ``spec.replicas`` (the client sends a strategic merge patch)."""
        self.apps.patch_namespaced_stateful_set_scale(self.workloads[role], self.namespace,
                                                      {"spec": {"replicas": replicas}})

    def pod_ip(self, pod: str, timeout: float = 0.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            ip = self.core.read_namespaced_pod(pod, self.namespace).status.pod_ip
            if ip or time.monotonic() >= deadline:
                if not ip:
                    raise ActionFailed(f"pod {pod} has no IP")
                return ip
            time.sleep(self.poll_s)

    # ---- actions ------------------------------------------------------------------------------------------------
    def _start(self, role: str) -> str:
        t0 = time.monotonic()
        n = self.replicas(role)
        self.scale(role, n + 1)
        pod = f"{self.workloads[role]}-{n}"
        ip = self.pod_ip(pod, self.start_timeout_secs)
        deadline = t0 + self.start_timeout_secs
        while time.monotonic() < deadline:
            if any(urlsplit(w["url"]).hostname == ip and w["role"] == role and w["healthy"]
                   for w in self.admin.workers()):
                return f"{pod} ({ip}) serving after {time.monotonic() - t0:.1f} s"
            time.sleep(self.poll_s)
        raise ActionFailed(f"{pod} ({ip}) was not serving after {self.start_timeout_secs:g} s")

    def _drain(self, view: ClusterView, role: str) -> str:
        t0 = time.monotonic()
        n = self.replicas(role)
        pod = f"{self.workloads[role]}-{n - 1}"  # the StatefulSet removes its highest ordinal
        ip = self.pod_ip(pod)
        worker = next((w for w in view.workers if urlsplit(w.url).hostname == ip and w.role == role), None)
        if worker is None:
            raise ActionFailed(f"the router lists no {role} worker at {pod}'s IP {ip}")
        self.drain_worker(worker)
        self.scale(role, n - 1)
        return f"{pod} drained in {time.monotonic() - t0:.1f} s, replicas {n} -> {n - 1}"

    def _switch(self, view: ClusterView, old: str, new: str) -> str:
        return f"{self._drain(view, old)}; {self._start(new)}"
