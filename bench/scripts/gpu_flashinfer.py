"""FlashInfer's paged decode in the GPU benchmark, on the same pool, pages and queries as our Triton kernel.

`FlashInferDecode` is the `companion` of `gpu_attention.decode_table`: it is
given the table's FP8 pool once (`prepare`) and each (batch, context) after
the Triton kernel is timed on it (`add`), and fills its own section. It runs
``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (plan once per shape, then
``run``; the plan is not timed, like our per-step split counts) in two
variants: the CUDA-core decode kernel and the tensor-core one
(``use_tensor_cores=True``, which FlashInfer recommends for large GQA groups).

Layout. Our pool's ``layer_cache(layer)`` views are
``[num_pages + 1, num_kv_heads, page_size, head_dim]`` with a strided page
axis: FlashInfer's ``HND`` layout, passed as a ``(k, v)`` tuple (FlashInfer
reads the page stride from the tensors and needs K and V to share it, which
they do). Our block tables become FlashInfer's CSR page table with
`paged_kv_indices`. FP8 E4M3 pages are passed as they are, with the per-layer
K and V scales as ``run(k_scale=, v_scale=)``; if this FlashInfer cannot run
or check FP8 pages at these shapes, bf16 pages (a dequantised copy of the same
pool) are used and the row says so.

Before any timing each variant is run on a small ragged batch (lengths 1, 63,
64, 65, 700, 1000 on scattered pages) and compared, row by row, with the torch
reference backend in float64 on the same pool bytes. A variant that does not
match is reported and not timed.

Without CUDA, or without the package, the section is one row that says why.
"""

from __future__ import annotations

import dataclasses

import torch

from pd_cluster.bench.scripts.gpu_attention import PAGE, Shape, batch_from_tables, decode_bytes, make_fp8_pool
from pd_cluster.bench.scripts.gpu_common import Ceilings, Row, Section, bench_ms, pct, sync
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.kv.pool import KVPool

INSTALL_HINT = ("pip install flashinfer-python, or pip install 'pd-cluster[flashinfer]'; without nvcc also "
                "flashinfer-cubin and flashinfer-jit-cache (precompiled kernels)")
TITLE = "FlashInfer paged decode, same pool, pages and queries as the FP8 decode table"
COLUMNS = ["batch", "context", "FlashInfer kernel", "KV pages", "time (us)", "GB/s", "% of copy BW",
           "triton FP8 (us)", "FlashInfer / triton time"]
VARIANTS = (("CUDA-core decode", False), ("tensor-core decode", True))
CHECK_LENS = (1, 63, 64, 65, 700, 1000)
CHECK_TOL = 2e-2  # per-row relative error; bf16 outputs are good to ~4e-3, a layout mistake gives O(1)
WORKSPACE_BYTES = 256 << 20
FP8, BF16 = "FP8 E4M3", "bf16 (FP8 failed, see notes)"  # the "KV pages" cell


def paged_kv_indices(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our block tables as FlashInfer's page table (``indptr``, ``indices``, ``last_page_len``).

    Args:
        block_tables: [B, W] page ids, request ``i``'s pages in order, padded with the null page 0.
        seq_lens: [B] tokens of each request.
        page_size: tokens per page.

    Returns:
        indptr: [B + 1] int32, request ``i``'s pages are ``indices[indptr[i]:indptr[i + 1]]``;
        indices: [sum of pages] int32, the first ``ceil(len / page_size)`` ids of each row, rows in order;
        last_page_len: [B] int32, tokens in each request's last page (1..page_size; 0 for an empty request).
    """
    seq = seq_lens.to(device=block_tables.device, dtype=torch.int64)
    n = (seq + page_size - 1) // page_size
    if int(n.max()) > block_tables.shape[1]:
        raise ValueError(f"a request needs {int(n.max())} pages but the block table has {block_tables.shape[1]}")
    indptr = torch.zeros(seq.numel() + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(n, 0)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < n[:, None]
    indices = block_tables[used].to(torch.int32)  # boolean indexing keeps row-major order
    last = torch.where(n > 0, seq - (n - 1) * page_size, torch.zeros_like(seq)).to(torch.int32)
    return indptr, indices, last


def probe(device: torch.device):
    """(the flashinfer module or None, a status line for the report)."""
    try:
        import flashinfer
    except ImportError as e:
        if e.name in (None, "flashinfer"):
            return None, f"not installed ({INSTALL_HINT})"
        return None, f"import failed ({e!r}); {INSTALL_HINT}"
    except Exception as e:  # a broken install (e.g. CUDA libraries it was built for are missing)
        return None, f"import failed ({e!r})"
    version = getattr(flashinfer, "__version__", "?")
    if device.type != "cuda":
        return None, f"{version} installed, not run (no CUDA device)"
    return flashinfer, version


def bf16_copy(pool: KVPool) -> KVPool:
    """The same pages dequantised into a bf16 pool (scales folded in), for a FlashInfer without FP8 decode."""
    lay = pool.layout
    ones = (1.0,) * lay.num_layers
    out = KVPool(dataclasses.replace(lay, kv_cache_dtype="bf16", k_scales=ones, v_scales=ones), pool.num_pages,
                 pool.device, torch.bfloat16)
    step = 2048
    for lo in range(0, pool.num_pages + 1, step):
        dst = out.kv[lo:lo + step]
        dst.copy_(pool.kv[lo:lo + step].view(torch.float8_e4m3fn) if pool.is_fp8 else pool.kv[lo:lo + step])
        for layer in range(lay.num_layers):
            dst[:, layer, 0].mul_(lay.k_scales[layer])
            dst[:, layer, 1].mul_(lay.v_scales[layer])
    return out


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``||out[i] - ref[i]|| / ||ref[i]||`` per request (float64)."""
    o, r = out.double().reshape(out.shape[0], -1), ref.double().reshape(ref.shape[0], -1)
    return (o - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-30)


class FlashInferDecode:
    """FlashInfer's decode on the decode table's shapes; `section` holds its rows."""

    def __init__(self, device: torch.device, ceil: Ceilings, module=None) -> None:
        """`module`: a flashinfer-like module to use instead of importing flashinfer (tests; any device)."""
        self.device, self.ceil = device, ceil
        self.section = Section(TITLE, COLUMNS)
        if module is not None:
            self.fi, status = module, getattr(module, "__version__", "?")
        else:
            self.fi, status = probe(device)
        self.modes: dict[str, str] = {}  # variant -> FP8 | BF16: the pages each checked variant runs on
        self._wrappers: dict[bool, object] = {}
        if self.fi is None:
            self.section.rows.append(Row([f"FlashInfer: {status}"] + ["-"] * (len(COLUMNS) - 1)))
            return
        self.version = status
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def prepare(self, pool: KVPool, shape: Shape) -> None:
        """Check each variant on a small ragged batch; keep the page dtype it runs correctly on."""
        if self.fi is None:
            return
        self.pool, self.shape, self._bf16 = pool, shape, None
        sec = self.section
        sec.notes.append(f"FlashInfer {self.version}; `BatchDecodeWithPagedKVCacheWrapper(workspace, \"HND\", "
                         f"use_tensor_cores=...)` on our pool's own pages (HND, strided page axis), block tables "
                         f"converted to indptr/indices/last_page_len; plan() not timed.")
        for name, tc in VARIANTS:
            mode, note = self._check(tc)
            sec.notes.append(f"{name}: {note}")
            if mode is None:
                sec.rows.append(Row(["-", "-", name, "-", "not timed (see notes)", "-", "-", "-", "-"]))
            else:
                self.modes[name] = mode
        sec.notes.append("GB/s counts bytes as the FP8 decode table does (K/V once, at 1 byte for FP8 pages and 2 "
                         "for bf16, plus q, out and block tables); with FP8 pages FlashInfer also scales the output "
                         "by v_scale in a separate op, which is timed.")

    def _check(self, tc: bool) -> tuple[str | None, str]:
        shape, dev = self.shape, self.device
        gen = torch.Generator().manual_seed(7)
        per = [-(-n // PAGE) for n in CHECK_LENS]
        small = make_fp8_pool(shape, sum(per) + 4, dev)
        ids = (torch.randperm(small.num_pages, generator=gen) + 1).tolist()
        tables = torch.zeros(len(CHECK_LENS), max(per), dtype=torch.int32)
        for i, p in enumerate(per):
            tables[i, :p] = torch.tensor([ids.pop() for _ in range(p)], dtype=torch.int32)
        batch = batch_from_tables(tables, list(CHECK_LENS), dev)
        q = torch.randn(len(CHECK_LENS), shape.num_heads, shape.head_dim, generator=gen).to(dev, torch.bfloat16)
        ref = self._reference(small, q, batch)
        why = []
        for label, name, pages in ((FP8, "FP8 E4M3", small), (BF16, "bf16", None)):
            try:
                pages = pages if pages is not None else bf16_copy(small)
                out = self._runner(tc, pages, batch, q)()
                sync(dev)
                err = float(row_errors(out, ref).max())
            except Exception as e:  # unsupported dtype/shape in this version, JIT compile failure, ...
                why.append(f"{name} pages failed: {repr(e)[:300]}")
                continue
            if err <= CHECK_TOL:
                checked = (f"{name} pages, output matches the float64 torch reference on lengths "
                           f"{list(CHECK_LENS)} (worst row relative error {err:.2g})")
                return label, "; ".join(why + [checked])
            why.append(f"{name} pages: output differs from the torch reference (worst row relative error "
                       f"{err:.3g} > {CHECK_TOL}), not timed")
        return None, "; ".join(why)

    def _reference(self, pool: KVPool, q: torch.Tensor, batch) -> torch.Tensor:
        """The torch reference backend in float64 over a copy of `pool`'s bytes."""
        ref_pool = KVPool(pool.layout, pool.num_pages, pool.device, torch.float64)
        ref_pool.kv.copy_(pool.kv)
        s = self.shape
        ref = TorchAttentionBackend(s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim ** -0.5)
        kv = torch.zeros(q.shape[0], s.num_kv_heads, s.head_dim, dtype=torch.float64, device=q.device)
        return ref.forward(0, q.double(), kv, kv, ref_pool, batch).view(q.shape)

    def _runner(self, tc: bool, pool: KVPool, batch, q: torch.Tensor):
        """Plan FlashInfer's decode for `batch` on `pool`; returns the call to time."""
        if tc not in self._wrappers:
            self._wrappers[tc] = self.fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND",
                                                                           use_tensor_cores=tc)
        wrapper, s = self._wrappers[tc], self.shape
        indptr, indices, last = paged_kv_indices(batch.block_tables, batch.seq_lens, pool.page_size)
        k, v = pool.layer_cache(0)
        wrapper.plan(indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_dim, pool.page_size,
                     q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=s.head_dim ** -0.5)
        scales = {"k_scale": pool.layout.k_scales[0], "v_scale": pool.layout.v_scales[0]} if pool.is_fp8 else {}
        return lambda: wrapper.run(q, (k, v), **scales)

    def add(self, bsz: int, ctx: int, batch, q: torch.Tensor, triton_ms: float) -> None:
        """Time each checked variant on this (batch, context) and add its row."""
        for name, tc in VARIANTS:
            mode = self.modes.get(name)
            if mode is None:
                continue
            try:
                pool = self.pool if mode == FP8 else self._bf16_pool()
                ms = bench_ms(self._runner(tc, pool, batch, q), self.device)
            except Exception as e:
                self.section.rows.append(Row([bsz, ctx, name, mode, "failed", repr(e)[:120], "-", triton_ms * 1e3,
                                              "-"]))
                continue
            gbps = decode_bytes(bsz, ctx, self.shape, 1 if mode == FP8 else 2) / (ms * 1e-3) / 1e9
            self.section.rows.append(Row([bsz, ctx, name, mode, ms * 1e3, gbps, pct(gbps, self.ceil.copy_gbps),
                                          triton_ms * 1e3, ms / triton_ms]))

    def _bf16_pool(self) -> KVPool:
        if self._bf16 is None:
            self._bf16 = bf16_copy(self.pool)
        return self._bf16


def summary_rows(sec: Section) -> list[Row]:
    """Per FlashInfer variant: the worst % of copy bandwidth at batch >= 32, context >= 4k (as for Triton)."""
    rows = []
    for name, _ in VARIANTS:
        vals = [r.cells[6] for r in sec.rows if r.cells[2] == name and isinstance(r.cells[6], float)
                and r.cells[0] >= 32 and r.cells[1] >= 4096]
        if vals:
            pages = next(r.cells[3] for r in sec.rows if r.cells[2] == name)
            rows.append(Row([f"FlashInfer {name} ({pages} pages), worst % of copy BW at batch >= 32, "
                             f"context >= 4k", min(vals), "-"]))
    return rows
