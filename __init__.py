"""pd-cluster: prefill/decode disaggregated LLM serving.

Every module lives under this one import name; the repository's role folders map onto it
(see ``[tool.setuptools]`` in ``pyproject.toml`` and ``docs/architecture.md``):

* ``pd_cluster.engine``: model execution (models, paged KV pool, attention, scheduler, sampling);
* ``pd_cluster.serving``: the HTTP layer shared by every worker (OpenAI API, engine thread, metrics);
* ``pd_cluster.prefill`` / ``pd_cluster.decode``: the two worker roles;
* ``pd_cluster.transfer``: KV transfer over NIXL;
* ``pd_cluster.router``: the OpenAI-compatible router;
* ``pd_cluster.bench``: the ``pd-bench`` load tool; ``pd_cluster.launch``: the launchers.
"""

__version__ = "0.1.0"
