"""The served model names the router accepts in ``model``.

``--served-model-name`` fixes them; otherwise they are learned from the
workers' ``/server_info`` (``served_model_name``, else ``model``). Before any
worker has answered, every name is passed on and the worker decides.
"""

from __future__ import annotations

from pd_cluster.router.workers import WorkerRegistry


class ModelNames:
    """Answers whether a requested model name is served."""

    def __init__(self, configured: tuple[str, ...], registry: WorkerRegistry) -> None:
        self._configured = frozenset(configured)
        self._registry = registry
        self._learned: frozenset[str] = frozenset()
        self._version = -1

    def names(self) -> list[str]:
        """Configured names, else the names reported by the workers (sorted)."""
        if self._configured:
            return sorted(self._configured)
        return sorted({w.served_model_name for w in self._registry.all() if w.served_model_name})

    def accepts(self, model: str) -> bool:
        if self._configured:
            return model in self._configured
        version = self._registry.version
        if version != self._version:  # recomputed only when a worker came, went or reported its name
            self._learned = frozenset(w.served_model_name for w in self._registry.all() if w.served_model_name)
            self._version = version
        return not self._learned or model in self._learned
