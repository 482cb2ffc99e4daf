"""Kernel launches per layer of a Llama decode step at Llama-3.1-8B's shape: at most 12 on the fused path.

What is counted (what a GPU would launch):

* every ATen operator a `TorchDispatchMode` sees inside a decoder layer,
  except views whose output aliases an input (``t``, ``view``, ``split``, a
  no-op ``to``; a ``to`` that converts is a copy kernel and counts) and pure
  allocations (``empty*``), which launch no kernel;
* every Triton kernel launch, as one op. On CPU the kernels run in Triton's
  interpreter, which moves tensors to and from numpy with torch ops of its own;
  those are not counted (on a GPU the launch is one kernel and nothing else).

The weights are dummy (``--load-format dummy``) and the model has 2 of the 8B's
32 layers (per-layer counts do not depend on depth; both layers must agree).
The unfused torch path is counted too, so the bound is seen to bite.
"""

from __future__ import annotations

import collections
import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import triton.runtime.interpreter as triton_interpreter
import triton.runtime.jit as triton_jit
from torch.utils._python_dispatch import TorchDispatchMode

from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend
from pd_cluster.engine.model.layer_ops import TORCH_OPS, TritonLayerOps
from pd_cluster.engine.model.loader import load_model
from kernel_cases import device, make_batch, make_pool

pytestmark = pytest.mark.slow  # runs long (an 8B-shaped 2-layer model, over 5 s on a 2-core CPU)

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = REPO / "engine" / "planner" / "configs" / "llama-3.1-8b.json"
MAX_LAUNCHES_PER_LAYER = 12
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _aliases(out, args) -> bool:
    """True when `out` is a view of an input (no kernel); False when a "maybe view" op such as
    ``aten.to`` made a copy (it converted dtype or device: a kernel)."""
    outs = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
    storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in outs)


class LaunchCounter(TorchDispatchMode):
    """Counts kernel launches per decoder layer (see the module docstring for what counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        self.in_triton = 0
        self.per_layer: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.layer is not None and not self.in_triton and func.overloadpacket.__name__ not in ALLOCATIONS \
                and not (func.is_view and _aliases(out, args)):
            self.per_layer[self.layer][f"aten.{func.overloadpacket.__name__}"] += 1
        return out

    def triton_launch(self, name: str) -> None:
        if self.layer is not None:
            self.per_layer[self.layer][f"triton.{name}"] += 1

    @contextlib.contextmanager
    def hooks(self, model, monkeypatch):
        def enter(i):
            return lambda module, args: setattr(self, "layer", i)

        handles = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(model.layers)]
        handles += [layer.register_forward_hook(lambda *a: setattr(self, "layer", None)) for layer in model.layers]
        counter = self
        for cls in (triton_interpreter.InterpretedFunction, triton_jit.JITFunction):
            original = cls.run

            def run(kernel, *args, _original=original, **kwargs):
                counter.triton_launch(getattr(kernel, "__name__", "kernel"))
                counter.in_triton += 1
                try:
                    return _original(kernel, *args, **kwargs)
                finally:
                    counter.in_triton -= 1

            monkeypatch.setattr(cls, "run", run)
        try:
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()


@pytest.fixture(scope="module")
def llama_8b_two_layers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-3.1-8b-2-layers")
    cfg = json.loads(LLAMA_8B.read_text())
    cfg["num_hidden_layers"] = 2
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if not k.startswith("_")}))
    loaded = load_model(str(folder), "float16", load_format="dummy", device=device())
    yield loaded
    shutil.rmtree(folder, ignore_errors=True)


def _count_decode_step(loaded, ops, monkeypatch) -> dict[int, collections.Counter]:
    arch = loaded.arch
    gen = torch.Generator().manual_seed(0)
    page_size, num_pages = 16, 24
    pool = make_pool("fp8", arch.num_key_value_heads, arch.head_dim, page_size, num_pages, torch.float16, gen,
                     num_layers=arch.num_hidden_layers)
    batch = make_batch([(37, 1), (5, 1), (70, 1), (16, 1)], 4, page_size, num_pages, gen)
    backend = TritonAttentionBackend(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim,
                                     arch.head_dim ** -0.5)
    loaded.model.set_layer_ops(ops)
    try:
        counter = LaunchCounter()
        with counter.hooks(loaded.model, monkeypatch):
            logits = loaded.model(batch, pool, backend)
    finally:
        loaded.model.set_layer_ops(TORCH_OPS)
    assert logits.shape == (4, arch.vocab_size) and torch.isfinite(logits).all()
    return counter.per_layer


def test_fused_decode_step_launches_at_most_12_kernels_per_layer(llama_8b_two_layers, monkeypatch):
    per_layer = _count_decode_step(llama_8b_two_layers, TritonLayerOps(), monkeypatch)
    assert sorted(per_layer) == [0, 1]
    first, second = per_layer[0], per_layer[1]
    # layer 0 has no residual add to fuse into its first norm; from layer 1 on every layer is the same
    counts = {i: sum(c.values()) for i, c in per_layer.items()}
    detail = {i: dict(sorted(c.items())) for i, c in per_layer.items()}
    assert max(counts.values()) <= MAX_LAUNCHES_PER_LAYER, detail
    assert second["triton._rms_norm_kernel"] == 2 and second["triton._rope_qk_kernel"] == 1, detail
    assert second["triton._act_and_mul_kernel"] == 1 and second["triton._store_kv_kernel"] == 1, detail
    assert sum(n for k, n in second.items() if k.startswith("triton._decode")) == 2, detail  # split + merge
    matmuls = sum(second[f"aten.{op}"] for op in ("linear", "mm", "addmm"))
    assert matmuls == 4, detail  # qkv, o, gate_up, down
    assert first.keys() == second.keys()


def test_unfused_torch_ops_exceed_the_bound(llama_8b_two_layers, monkeypatch):
    """The same count on the reference ops: the fused kernels are what brings it under 12."""
    per_layer = _count_decode_step(llama_8b_two_layers, TORCH_OPS, monkeypatch)
    assert sum(per_layer[1].values()) > 3 * MAX_LAUNCHES_PER_LAYER, dict(per_layer[1])  # 41 counted here
