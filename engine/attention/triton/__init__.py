"""Triton kernels of the GPU attention path (also run by Triton's interpreter, ``TRITON_INTERPRET=1``).

* `store.store_kv`: write a step's K/V into pool slots, quantising to FP8 E4M3;
* `decode.decode_attention`: paged flash-decoding with grouped query heads;
* `extend.extend_attention`: chunked-prefill attention over cached pages plus the chunk.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with
``@triton.jit``. On a machine without CUDA the kernels can only run in the
interpreter: the entry points set ``TRITON_INTERPRET=1`` there before this
package is imported (`pd_cluster.launch.interpreter`); importing it changes no
environment variable. The
kernels avoid Triton's own jit-defined library functions (see `primitives`),
so this works even when ``triton`` was imported earlier. An explicit
``TRITON_INTERPRET=0`` is respected (ahead-of-time compilation for a GPU
target, as `bench/scripts/gpu_compile.py` does).
"""

from pd_cluster.engine.attention.triton.decode import DecodeKernelConfig, DecodeWorkspace, decode_attention, num_kv_splits  # noqa: E402
from pd_cluster.engine.attention.triton.extend import ExtendKernelConfig, extend_attention  # noqa: E402
from pd_cluster.engine.attention.triton.store import store_kv  # noqa: E402

__all__ = ["DecodeKernelConfig", "DecodeWorkspace", "ExtendKernelConfig", "decode_attention", "extend_attention",
           "num_kv_splits", "store_kv"]
