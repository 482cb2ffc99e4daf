"""Where the Triton kernels run on a machine without CUDA: the entry points decide, not an import.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated with ``@triton.jit``, so the choice must be made
before `pd_cluster.engine.attention.triton` is imported. The command-line entry points (``pd-worker``,
``pd-generate``) and the kernel tests call `use_triton_interpreter_without_cuda` first; a library user of
``LLM(attention_backend="triton")`` on a machine without CUDA sets ``TRITON_INTERPRET=1`` themselves. Importing
the engine never changes the process's environment.
"""

from __future__ import annotations

import os


def use_triton_interpreter_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is present and the variable is unset.

    An explicit value (``TRITON_INTERPRET=0`` for ahead-of-time compilation) is left alone.
    Returns True when the Triton kernels will run in the interpreter.
    """
    if os.environ.get("TRITON_INTERPRET") is None:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET") == "1"
