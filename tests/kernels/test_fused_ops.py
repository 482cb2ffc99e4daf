"""Fused Triton layer ops (RMSNorm + residual, RoPE on q and k, SiLU-and-mul) against the torch reference.

The reference is `TorchLayerOps` run in float64 on the same inputs (and, for
RoPE, the same float64 cos/sin table); every row (token) must be within the
dtype's bound (`kernel_cases.REL_ERR_BOUND`). Shapes: odd token counts, hidden
sizes that are and are not powers of two (stories260K's 64, Qwen's 896, a
non-power 1000), Llama-3.1-8B's head layout (32 q / 8 kv heads of 128) and
head dims 64 and 80. Outputs are poisoned with NaN before each run.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.triton import fused
from pd_cluster.engine.model.layer_ops import TorchLayerOps, TritonLayerOps
from pd_cluster.engine.model.rope import RotaryEmbedding
from kernel_cases import REL_ERR_BOUND, device, rel_err, row_rel_errs

DTYPES = [torch.float16, torch.float32]
REF = TorchLayerOps()


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device(), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 896), (5, 1000), (3, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, tokens, hidden, with_residual):
    gen = torch.Generator().manual_seed(tokens * hidden)
    x = _randn(tokens, hidden, dtype=dtype, gen=gen, scale=3.0)
    res = _randn(tokens, hidden, dtype=dtype, gen=gen) if with_residual else None
    w = _randn(hidden, dtype=dtype, gen=gen)
    out, new_res = fused.rms_norm(x, w, 1e-5, res)
    want, want_res = REF.rms_norm(x.double(), w.double(), 1e-5, None if res is None else res.double())
    assert rel_err(out, want) <= REL_ERR_BOUND[dtype]
    if with_residual:
        # the sum is rounded once to the activation dtype: exactly torch's add
        assert torch.equal(new_res, x + res)
        assert rel_err(new_res, want_res) <= REL_ERR_BOUND[dtype]
    else:
        assert new_res is None
    same_dtype, _ = REF.rms_norm(x, w, 1e-5, res)  # the reference at the kernel's own dtype agrees too
    assert rel_err(out, same_dtype) <= REL_ERR_BOUND[dtype]


def test_rms_norm_rows_are_independent():
    """A row of large values beside small ones: each row is normalised on its own (and checked on its own)."""
    gen = torch.Generator().manual_seed(1)
    x = _randn(4, 256, dtype=torch.float32, gen=gen)
    x[2] *= 1e4
    w = _randn(256, dtype=torch.float32, gen=gen)
    out, _ = fused.rms_norm(x, w, 1e-6)
    want, _ = REF.rms_norm(x.double(), w.double(), 1e-6)
    assert (row_rel_errs(out, want) <= REL_ERR_BOUND[torch.float32]).all()


ROPE_SCALINGS = [None, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,head_dim", [(1, 32, 8, 128), (6, 4, 4, 64), (5, 14, 2, 80), (3, 8, 1, 32)])
def test_rope_qk_in_place_on_qkv_views(dtype, tokens, hq, hk, head_dim):
    gen = torch.Generator().manual_seed(tokens + hq)
    q_size, kv_size = hq * head_dim, hk * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    v_before = qkv[:, q_size + kv_size:].clone()
    q = qkv[:, :q_size].view(tokens, hq, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, hk, head_dim)
    q0, k0 = q.double().clone(), k.double().clone()
    positions = torch.randint(0, 100_000, (tokens,), generator=gen)
    # the table is built where the module lives (CPU) and moved, as the model builds it on its own device
    cos, sin = (t.to(device()) for t in RotaryEmbedding(head_dim, 500000.0, None, 131072).cos_sin(positions,
                                                                                                  torch.float64))
    fused.rope_qk(q, k, cos.float(), sin.float())
    want_q, want_k = REF.rope_qk(q0, k0, cos, sin)
    assert rel_err(q, want_q) <= REL_ERR_BOUND[dtype]
    assert rel_err(k, want_k) <= REL_ERR_BOUND[dtype]
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)  # v untouched


@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=lambda s: (s or {}).get("rope_type", "default"))
def test_rope_qk_every_scaling_type(scaling):
    """The kernel takes the step's cos/sin table, so every scaling the loader supports (and YaRN's
    attention factor) reaches it unchanged; checked against the reference rotation."""
    gen = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(64, 10000.0, scaling, 4096).to(device())
    positions = torch.tensor([0, 1, 17, 4095, 20000, 131071], device=device())
    q = _randn(6, 4, 64, dtype=torch.float32, gen=gen)
    k = _randn(6, 2, 64, dtype=torch.float32, gen=gen)
    want_q, want_k = REF.rope_qk(q.double(), k.double(), *rope.cos_sin(positions, torch.float64))
    ops = TritonLayerOps()
    got_q, got_k = ops.rope_qk(q, k, *rope.cos_sin(positions, ops.cos_sin_dtype(q.dtype)))
    assert rel_err(got_q, want_q) <= REL_ERR_BOUND[torch.float32]
    assert rel_err(got_k, want_k) <= REL_ERR_BOUND[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (7, 172), (4, 1500), (2, 14336)])
def test_silu_and_mul(dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * inter)
    x = _randn(tokens, 2 * inter, dtype=dtype, gen=gen, scale=4.0)
    out = fused.silu_and_mul(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert rel_err(out, REF.silu_and_mul(x.double())) <= REL_ERR_BOUND[dtype]
    assert rel_err(out, REF.silu_and_mul(x)) <= REL_ERR_BOUND[dtype]


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=device())
    assert fused.rms_norm(x, torch.ones(64, device=device()), 1e-5)[0].shape == (0, 64)
    assert fused.silu_and_mul(torch.empty(0, 128, device=device())).shape == (0, 64)


def test_the_row_check_catches_an_error_in_one_row():
    """An error confined to one row of many fails the per-row check although the batch-wide norm passes."""
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    out = ref.clone()
    out[5] *= 1 + 5e-3
    batch_wide = float((out - ref).norm() / ref.norm())
    assert batch_wide <= REL_ERR_BOUND[torch.float16] < rel_err(out, ref)


def test_strided_inputs_are_handled():
    """A column-strided input (not what the model passes, but allowed) is made contiguous, not misread."""
    gen = torch.Generator().manual_seed(5)
    x = _randn(64, 6, dtype=torch.float32, gen=gen).t()  # [6, 64], stride (1, 6)
    w = _randn(64, dtype=torch.float32, gen=gen)
    out, _ = fused.rms_norm(x, w, 1e-5)
    assert rel_err(out, REF.rms_norm(x.double(), w.double(), 1e-5)[0]) <= REL_ERR_BOUND[torch.float32]
    g = _randn(128, 3, dtype=torch.float32, gen=gen).t()
    assert rel_err(fused.silu_and_mul(g), REF.silu_and_mul(g.double())) <= REL_ERR_BOUND[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["gemma", "float"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_styles(dtype, style, with_residual):
    """Gemma's ``(1 + w)`` norm and gpt-oss's float32 product (Llama 4's L2 norm is the latter with ones)."""
    gen = torch.Generator().manual_seed(len(style))
    x = _randn(5, 200, dtype=dtype, gen=gen, scale=3.0)
    res = _randn(5, 200, dtype=dtype, gen=gen) if with_residual else None
    w = _randn(200, dtype=dtype, gen=gen, scale=0.3)
    out, new_res = fused.rms_norm(x, w, 1e-6, res, style)
    want, _ = REF.rms_norm(x.double(), w.double(), 1e-6, None if res is None else res.double(), style)
    assert rel_err(out, want) <= REL_ERR_BOUND[dtype]
    if style == "gemma":  # the offset matters (the float style differs from Llama's by a rounding only)
        llama, _ = REF.rms_norm(x.double(), w.double(), 1e-6, None if res is None else res.double())
        assert rel_err(llama, want) > 0.1
    if with_residual:
        assert torch.equal(new_res, x + res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (7, 172), (4, 1500)])
def test_gelu_tanh_and_mul(dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * inter + 1)
    x = _randn(tokens, 2 * inter, dtype=dtype, gen=gen, scale=4.0)
    out = fused.gelu_tanh_and_mul(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert rel_err(out, REF.gelu_tanh_and_mul(x.double())) <= REL_ERR_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_clamped(dtype):
    """gpt-oss's activation, with values on both sides of the clamp (limit 7, inputs up to ~12)."""
    gen = torch.Generator().manual_seed(2)
    x = _randn(9, 2 * 300, dtype=dtype, gen=gen, scale=4.0)
    out = fused.swiglu_clamped(x, 1.702, 7.0)
    want = REF.swiglu_clamped(x.double(), 1.702, 7.0)
    assert rel_err(out, want) <= REL_ERR_BOUND[dtype]
    assert rel_err(REF.swiglu_clamped(x.double(), 1.702, 1e9), want) > 0.01  # the clamp acts on these inputs
