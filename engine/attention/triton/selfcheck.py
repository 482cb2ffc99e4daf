"""Start-up self-check: compile and run one tiny Triton kernel before the worker reports ready.

Triton compiles a kernel's host launcher with a C compiler against ``Python.h``
the first time the kernel runs, and caches the result in ``TRITON_CACHE_DIR``.
An image without a compiler or the Python headers, or a read-only cache
directory, therefore fails at the first forward pass (CUDA-graph capture, or
the first request), long after the pod looked healthy. `check_triton_runtime`
moves that failure to start-up and names its cause; `build_shard` calls it when
the attention backend is ``triton``.

Under ``TRITON_INTERPRET=1`` (CPU) the same kernel runs in the interpreter,
which compiles nothing; the check then only proves the kernel path works.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

import torch
import triton
import triton.language as tl


class TritonRuntimeError(RuntimeError):
    """Triton cannot compile or run kernels on this machine (the message names the likely cause)."""


@triton.jit
def _selfcheck_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask)
    tl.store(Y + offs, x * 2 + 1, mask=mask)


def _environment() -> str:
    """What the compile step depends on, for the error message."""
    include = sysconfig.get_paths().get("include") or "?"
    has_header = os.path.exists(os.path.join(include, "Python.h"))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return (f"C compiler: {cc or 'none found (set CC or install gcc)'}; "
            f"Python.h: {'found' if has_header else 'missing'} in {include} (install python3-dev); "
            f"TRITON_CACHE_DIR: {cache} ({'writable' if _writable(cache) else 'not writable'})")


def _writable(path: str) -> bool:
    probe = path
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return bool(probe) and os.access(probe, os.W_OK)


def check_triton_runtime(device: torch.device) -> None:
    """Compile and run a 16-element kernel on `device`; check its output.

    Args:
        device: the worker's device (``cuda:N``; on CPU the interpreter runs it).

    Raises:
        TritonRuntimeError: the kernel did not compile or launch, or wrote wrong
            values; the message includes the compiler, header and cache status.
    """
    n = 13
    x = torch.arange(n, dtype=torch.float32, device=device)
    y = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    try:
        _selfcheck_kernel[(1,)](x, y, n, BLOCK=16)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # the compiler's own error follows; ours says what to fix
        raise TritonRuntimeError(
            f"Triton could not compile or run a kernel on {device}: {type(e).__name__}: {e}. "
            f"The triton attention backend needs a C compiler and the Python headers to build its "
            f"launchers, and a writable cache. {_environment()}. Use the project's Dockerfile (gcc, "
            f"python3-dev), or start with --attention-backend torch.") from e
    if not torch.equal(y.cpu(), x.cpu() * 2 + 1):
        raise TritonRuntimeError(f"Triton's self-check kernel ran on {device} but wrote wrong values "
                                 f"{y.cpu().tolist()}; the Triton install does not match this device or driver.")
