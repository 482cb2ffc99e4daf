"""CPU attention backend: a compiled paged attention kernel for decodes and prefill chunks alike.

The decode kernel (``csrc/paged_decode.c``) reads each request's K and V
pages in place through the block table with an online softmax: one pass over
the KV, no gathered copy, no padding. The torch reference path gathers and
pads, which on a CPU costs several passes over the same bytes. The kernel is
plain C: it is compiled with the system C compiler on first use (about one
second), cached under ``$PD_CACHE_DIR`` (default ``~/.cache/pd-cluster``) by
source hash, and called through ctypes. `available` says whether that
worked; the ``auto`` backend falls back to ``torch`` when it did not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend, first_visible
from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.kv.pool import KVPool

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.c"
# -ffast-math lets gcc vectorise expf (glibc's libmvec); the kernel has no inf/NaN logic to lose. It is given to
# the compile step only: linking with it adds crtfastmath.o (gcc < 13), which sets flush-to-zero and
# denormals-are-zero for the whole process the moment the library loads, changing torch's numerics everywhere.
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
_LDFLAGS = ("-shared", "-fopenmp")
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _cache_dir() -> Path:
    return Path(os.environ.get("PD_CACHE_DIR", Path.home() / ".cache" / "pd-cluster"))


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """Compile (once per source version and machine) and load the kernel.

    Raises:
        OSError, subprocess.CalledProcessError: no compiler, or the build failed.
    """
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS + _LDFLAGS).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"libpd_paged_decode-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        with tempfile.NamedTemporaryFile(dir=lib.parent, suffix=".so", delete=False) as tmp:
            tmp_path = tmp.name
        obj_path = tmp_path[:-3] + ".o"
        try:
            subprocess.run([cc, *_CFLAGS, "-c", "-o", obj_path, str(_SOURCE)],
                           check=True, capture_output=True, timeout=120)
            subprocess.run([cc, *_LDFLAGS, "-o", tmp_path, obj_path, "-lm"],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp_path, lib)  # atomic: concurrent builders (several workers) never see a partial file
        finally:
            for path in (tmp_path, obj_path):
                if os.path.exists(path):
                    os.unlink(path)
    so = ctypes.CDLL(str(lib))
    so.pd_paged_decode.restype = ctypes.c_int
    so.pd_paged_decode.argtypes = ([_P, _P, ctypes.c_int, _P, _P, _P, _P, _P, _F32, _P] + [_I64] * 8 + [_F32] * 3
                                   + [_P, ctypes.c_int])
    so.pd_scratch_floats.restype = _I64
    so.pd_scratch_floats.argtypes = [_I64] * 4
    return so


def available() -> bool:
    """True when the kernel builds (or is cached) here."""
    try:
        _library()
        return True
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU paged-decode kernel unavailable (%s: %s); using the torch attention backend",
                       type(e).__name__, getattr(e, "stderr", "") or e)
        return False


def paged_decode(q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, starts: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 softcap: float | None = None, owners: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one query per request, straight from the pool.

    Args:
        q: [B, num_heads, head_dim] float32, contiguous.
        block_tables: [R, max_pages] int32, contiguous (padding: the null page): row b's table is row b, or
            row ``owners[b]``.
        seq_lens: [B] int32 context lengths (the current token included).
        owners: [B] int32 each row's table row (a prefill chunk's tokens share their request's), or None.
        starts: [B] int32 first visible key position of each row (a window or chunk), contiguous; None: 0.
        sinks: [num_heads] float32 sink logits (gpt-oss), contiguous, or None.
        softcap: scores become ``softcap * tanh(s / softcap)`` (Gemma 2), or None.

    Returns:
        [B, num_heads, head_dim] float32. Uses ``torch.get_num_threads()`` threads (``--cpu-threads``).
    """
    b, hq, d = q.shape
    kv = pool.kv
    _, num_layers, _, hkv, ps, _ = kv.shape
    out = torch.empty_like(q)
    lib = _library()
    threads = max(torch.get_num_threads(), 1)
    per_thread = lib.pd_scratch_floats(hq // hkv, block_tables.shape[1], ps, d)
    if owners is not None and (owners.numel() != b or int(owners.max()) >= block_tables.shape[0]):
        raise ValueError(f"owners {tuple(owners.shape)} do not index the {block_tables.shape[0]} table rows")
    scratch = torch.empty(per_thread * threads, dtype=torch.float32)
    k_scale, v_scale = pool.layer_scales(layer)
    rc = lib.pd_paged_decode(q.data_ptr(), kv.data_ptr(), _DTYPE_CODE[kv.dtype], block_tables.data_ptr(),
                             None if owners is None else owners.data_ptr(), seq_lens.data_ptr(), None if starts is None else starts.data_ptr(),
                             None if sinks is None else sinks.data_ptr(), float(softcap or 0.0),
                             out.data_ptr(), b, hq, hkv, d, ps, num_layers, pool.layer_slot(layer),
                             block_tables.shape[1], scale, k_scale, v_scale, scratch.data_ptr(), threads)
    if rc != 0:
        raise ValueError(f"pd_paged_decode rejected its arguments (q {tuple(q.shape)}, kv {tuple(kv.shape)})")
    return out


class CpuAttentionBackend(TorchAttentionBackend):
    """Every query token of a step through the compiled kernel, every attention type (windows and chunks as
    each row's first visible key, sinks, softcapping); the torch reference when the pool is not on the CPU.

    A windowed or chunked layer's row reads only the pages it can see, so a long prompt's local layers cost
    ``tokens x window``, and the scratch is one row's scores per thread: no ``chunk x context`` scores exist.

    Raises:
        ImportError: the kernel cannot be built here.
    """

    name = "cpu"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not available():
            raise ImportError("the CPU paged-decode kernel could not be built (see the log)")

    def prepare(self, batch: ForwardBatch, pool: KVPool) -> None:
        """Per step: one row per query token, each with its request's block table and causal length.

        A prefill token at position p attends to positions 0..p, exactly what a decode query with
        ``seq_len = p + 1`` does, so the whole step (decodes and prefill chunks) is one kernel call per layer.
        Each distinct window or chunk gets its rows' first visible positions, once per step. A row names its
        request's table row (``owners``), so a chunk's tokens share one table: no ``tokens x pages`` copy.
        """
        if pool.kv.device.type != "cpu":
            return super().prepare(batch, pool)
        self._prepared_for = batch
        self._groups = []
        self._tables = batch.block_tables.to(torch.int32).contiguous()
        self._owners = None
        if not batch.is_decode_only:
            lens = torch.tensor(batch.query_lens_cpu, dtype=torch.long)
            self._owners = torch.repeat_interleave(torch.arange(len(lens)), lens).to(torch.int32).contiguous()
        self._lens = (batch.positions + 1).to(torch.int32).contiguous()
        self._starts: dict[tuple[str, int], torch.Tensor | None] = {}
        for spec in self.specs:
            if spec.mask_key not in self._starts:
                starts = None if spec.kind == "full" else first_visible(spec, batch.positions)
                self._starts[spec.mask_key] = None if starts is None else starts.to(torch.int32).contiguous()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: KVPool, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if pool.kv.device.type != "cpu":
            return super().forward(layer, q, k, v, pool, batch, sinks)
        if getattr(self, "_prepared_for", None) is not batch:
            self.prepare(batch, pool)
        spec = self.spec(layer)
        pool.store_kv(layer, k, v, batch.slot_mapping)
        sink_logits = sinks.float().contiguous() if sinks is not None and spec.sinks else None
        out = paged_decode(q.float().contiguous(), pool, layer, self._tables, self._lens, self.scale,
                           self._starts[spec.mask_key], sink_logits, spec.logit_softcap, self._owners)
        return out.to(q.dtype).view(q.shape[0], -1)
