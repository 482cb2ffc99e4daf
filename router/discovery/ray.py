"""Discovery of workers that run as named Ray actors.

Contract with the launcher: each worker is a named actor in the Ray namespace
``--ray-namespace`` whose name starts with ``--ray-actor-prefix``, and it has
a method ``endpoint()`` returning ``{"url": "http://host:port", "role":
"prefill" | "decode" | "mixed"}``. Ray has no watch on named actors, so the
source lists them and asks each for its endpoint every ``--ray-poll-secs``; an
actor that is gone is removed, and one that Ray restarted on a new URL is
moved there. Workers found this way still need a health
check before use. ``ray`` is imported only when this source is used.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pd_cluster.router.config import RayDiscoveryConfig, Role
from pd_cluster.router.discovery.base import DiscoverySource, RegistrySink

log = logging.getLogger("pd_cluster.router.discovery.ray")

ENDPOINT_TIMEOUT_SECS = 10.0


def parse_endpoint(value: Any) -> tuple[str, Role]:
    """``endpoint()``'s answer as (url, role); raises ``ValueError`` when malformed."""
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise ValueError(f"endpoint() must return {{'url', 'role'}}, got {value!r}")
    return value["url"], Role(value.get("role"))


class RayDiscovery(DiscoverySource):
    """Polls named actors; one daemon thread."""

    def __init__(self, cfg: RayDiscoveryConfig) -> None:
        self.cfg = cfg
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._known: dict[str, tuple[str, Role]] = {}
        self.polls = 0

    def start(self, sink: RegistrySink) -> None:
        self._thread = threading.Thread(target=self._run, args=(sink,), name="ray-discovery",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _connect(self):
        import ray

        if not ray.is_initialized():
            ray.init(address=self.cfg.address, namespace=self.cfg.namespace,
                     ignore_reinit_error=True, log_to_driver=False)
        return ray

    def _run(self, sink: RegistrySink) -> None:
        try:
            ray = self._connect()
        except Exception as exc:
            log.error("cannot connect to Ray", extra={"address": self.cfg.address,
                                                      "error": repr(exc)})
            return
        while not self._stop.is_set():
            try:
                self.poll(ray, sink)
            except Exception as exc:
                log.warning("ray discovery poll failed", extra={"error": repr(exc)})
            self._stop.wait(self.cfg.poll_secs)

    def _names(self, ray) -> set[str]:
        listed = ray.util.list_named_actors(all_namespaces=True)
        return {a["name"] for a in listed
                if a.get("namespace") == self.cfg.namespace
                and a["name"].startswith(self.cfg.actor_prefix)}

    def poll(self, ray, sink: RegistrySink) -> None:
        """One listing: ask every actor for its endpoint, drop vanished ones, reconcile the registry.

        Known actors are asked again on every poll: Ray restarts a dead actor under the same name
        (``max_restarts``) and the restarted one serves on a new URL, which replaces the old one. An actor
        that does not answer in time keeps its last endpoint (the health checks judge that URL).
        """
        names = self._names(ray)
        for gone in set(self._known) - names:
            del self._known[gone]
        refs = {}
        for name in names:
            try:
                refs[name] = ray.get_actor(name, namespace=self.cfg.namespace).endpoint.remote()
            except Exception as exc:
                log.warning("ray actor endpoint unavailable", extra={"actor": name, "error": repr(exc)})
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=ENDPOINT_TIMEOUT_SECS)
        for name, ref in refs.items():
            try:
                found = parse_endpoint(ray.get(ref, timeout=0))
            except Exception as exc:
                if name not in self._known:
                    log.warning("ray actor endpoint unavailable", extra={"actor": name, "error": repr(exc)})
                continue
            if name in self._known and self._known[name] != found:
                log.info("ray actor moved (restarted)", extra={"actor": name, "from": self._known[name][0],
                                                               "to": found[0]})
            self._known[name] = found
        self.polls += 1
        wanted = {url: role for url, role in self._known.values()}
        sink.replace(wanted, set(Role))
