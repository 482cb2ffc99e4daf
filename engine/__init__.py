"""pd-cluster's model-execution engine, shared by the prefill, decode and mixed roles.

The offline API has vLLM's shape::

    from pd_cluster.engine import LLM, SamplingParams
    llm = LLM()                       # None/absent model: the embedded stories260K
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=64))
    print(out[0].text)

Heavy modules (torch) load on first use, so light users of the package
(the router, `pd-bench`) can import `pd_cluster.engine.assets` or `pd_cluster.serving.protocol`
without paying for torch.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    "LLM": "pd_cluster.engine.llm",
    "SamplingParams": "pd_cluster.engine.sampling.params",
    "RequestOutput": "pd_cluster.engine.outputs",
    "CompletionOutput": "pd_cluster.engine.outputs",
    "EngineConfig": "pd_cluster.engine.config",
    "LLMEngine": "pd_cluster.engine.llm_engine",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
