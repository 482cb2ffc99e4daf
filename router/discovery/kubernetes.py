"""Kubernetes pod discovery with the official ``kubernetes`` client.

Per role with a selector (``--prefill-selector``, ``--decode-selector``,
``--selector`` for mixed workers) one thread lists the pods of the namespace,
reconciles the registry to the Ready ones, then watches from the list's
``resourceVersion``. A pod is used only while it is Running, Ready, has an IP
and is not being deleted. Each watch event is applied as it arrives. A watch
that ends (server timeout) resumes from the last seen version; a 410 Gone
(version too old) relists; every ``--service-discovery-resync-secs`` it
relists anyway. RBAC needs only ``get``, ``list`` and ``watch`` on pods.

The worker's port is the pod annotation ``--service-discovery-port-annotation``
when present, else ``--service-discovery-port``. The approach is that of
SGLang's router service discovery.
"""

from __future__ import annotations

import logging
import threading
import time

from kubernetes import client, config as kube_config, watch
from kubernetes.client.rest import ApiException

from pd_cluster.router.config import KubernetesDiscoveryConfig, Role
from pd_cluster.router.discovery.base import DiscoverySource, RegistrySink

log = logging.getLogger("pd_cluster.router.discovery.kubernetes")

ERROR_BACKOFF_SECS = 2.0


def load_kube_config(kubeconfig: str | None) -> client.ApiClient:
    """In-cluster config when running in a pod, else ``kubeconfig`` (or ~/.kube/config)."""
    if kubeconfig is None:
        try:
            kube_config.load_incluster_config()
            return client.ApiClient()
        except kube_config.ConfigException:
            pass
    return kube_config.new_client_from_config(config_file=kubeconfig)


def pod_is_ready(pod: client.V1Pod) -> bool:
    """Running, Ready condition True, has an IP, not terminating."""
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None:
        return False
    if status.phase != "Running" or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


def pod_url(pod: client.V1Pod, cfg: KubernetesDiscoveryConfig) -> str | None:
    """``scheme://ip:port`` of the pod's worker, or ``None`` without an IP or with a bad port."""
    ip = pod.status.pod_ip if pod.status else None
    if not ip:
        return None
    port: int | str = cfg.port
    annotations = pod.metadata.annotations or {}
    if cfg.port_annotation in annotations:
        port = annotations[cfg.port_annotation]
        if not str(port).isdigit():
            log.error("bad port annotation", extra={"pod": pod.metadata.name, "value": port})
            return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"{cfg.scheme}://{host}:{int(port)}"


class KubernetesDiscovery(DiscoverySource):
    """List-and-watch of worker pods, one daemon thread per role."""

    ready_means_healthy = True

    def __init__(self, cfg: KubernetesDiscoveryConfig, api_client: client.ApiClient) -> None:
        self.cfg = cfg
        self.api = client.CoreV1Api(api_client)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.lists = 0
        self.watch_starts = 0

    def selectors(self) -> list[tuple[str, Role]]:
        cfg = self.cfg
        pairs = [(cfg.prefill_selector, Role.PREFILL), (cfg.decode_selector, Role.DECODE),
                 (cfg.worker_selector, Role.MIXED)]
        return [(s, r) for s, r in pairs if s]

    def start(self, sink: RegistrySink) -> None:
        for selector, role in self.selectors():
            t = threading.Thread(target=self._run, args=(sink, selector, role),
                                 name=f"k8s-discovery-{role.value}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def _run(self, sink: RegistrySink, selector: str, role: Role) -> None:
        known: dict[str, str] = {}
        while not self._stop.is_set():
            try:
                version = self._list(sink, selector, role, known)
                deadline = time.monotonic() + self.cfg.resync_secs
                while not self._stop.is_set() and time.monotonic() < deadline:
                    version = self._watch(sink, selector, role, known, version, deadline)
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch version expired (410 Gone); relisting",
                             extra={"role": role.value})
                    continue
                log.warning("kubernetes API error", extra={"role": role.value,
                                                           "status": exc.status})
                self._stop.wait(ERROR_BACKOFF_SECS)
            except Exception as exc:  # network errors of any client layer: back off, relist
                log.warning("kubernetes discovery error", extra={"role": role.value,
                                                                 "error": repr(exc)})
                self._stop.wait(ERROR_BACKOFF_SECS)

    def _list(self, sink: RegistrySink, selector: str, role: Role,
              known: dict[str, str]) -> str:
        pods = self.api.list_namespaced_pod(self.cfg.namespace, label_selector=selector,
                                            _request_timeout=30)
        self.lists += 1
        known.clear()
        for pod in pods.items:
            url = pod_url(pod, self.cfg)
            if url is not None and pod_is_ready(pod):
                known[pod.metadata.name] = url
        sink.replace({url: role for url in known.values()}, {role})
        return pods.metadata.resource_version

    def _watch(self, sink: RegistrySink, selector: str, role: Role, known: dict[str, str],
               version: str, deadline: float) -> str:
        timeout = max(1, min(self.cfg.watch_timeout_secs, int(deadline - time.monotonic()) + 1))
        w = watch.Watch()
        self.watch_starts += 1
        for event in w.stream(self.api.list_namespaced_pod, self.cfg.namespace,
                              label_selector=selector, resource_version=version,
                              timeout_seconds=timeout, allow_watch_bookmarks=True,
                              _request_timeout=(10, timeout + 30)):
            kind = event["type"]
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self._apply(sink, role, known, kind, event["object"])
            if self._stop.is_set():
                w.stop()
        return w.resource_version or version

    def _apply(self, sink: RegistrySink, role: Role, known: dict[str, str], kind: str,
               pod: client.V1Pod) -> None:
        name = pod.metadata.name
        old = known.get(name)
        url = pod_url(pod, self.cfg) if kind != "DELETED" else None
        if url is not None and pod_is_ready(pod):
            if old is not None and old != url:
                sink.remove(old)
            known[name] = url
            sink.upsert(url, role)
        elif old is not None:
            del known[name]
            sink.remove(old)
