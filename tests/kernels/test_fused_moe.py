"""The fused MoE Triton kernel against the torch path (`torch_fused_experts`), in Triton's interpreter on CPU.

The reference runs in float64 on the same (rounded) inputs; each token's row is checked on its own against
``||out[t] - ref[t]|| / ||ref[t]||``: float32 1e-5, fp16 2e-3 (the kernel rounds the gate/up output and each
expert's product to fp16, as the torch path does). Every row must be finite, and a row whose choices all
belong to other ranks must be exactly zero.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.triton.fused_moe import FusedMoEKernelConfig, fused_experts, moe_align
from pd_cluster.engine.model.layer_ops import torch_fused_experts

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int, drop: float = 0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(DEVICE, dtype)
    weights, ids = torch.randn(t, e, generator=gen).softmax(-1).topk(k, dim=-1)
    if drop:  # expert parallelism: choices another rank computes are -1
        ids = torch.where(torch.rand(ids.shape, generator=gen) < drop, -1, ids)
    return x, w13, w2, weights.to(DEVICE), ids.to(DEVICE)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    zero = ref.norm(dim=-1) == 0
    assert (out[zero] == 0).all()
    assert err[~zero].max() <= BOUND[dtype], err.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t, e, k, h, i", [(1, 4, 2, 64, 32), (5, 4, 1, 64, 32), (37, 8, 3, 48, 40),
                                           (130, 16, 4, 64, 96)])
def test_fused_experts_equal_the_torch_path(t, e, k, h, i, dtype):
    x, w13, w2, weights, ids = _case(t, e, k, h, i, dtype, seed=t + e)
    ref = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    _check(fused_experts(x, w13, w2, weights, ids), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_choices_of_other_ranks_contribute_nothing(dtype):
    x, w13, w2, weights, ids = _case(40, 4, 2, 64, 32, dtype, seed=11, drop=0.4)
    ids[0] = -1  # a token whose every choice is elsewhere: a zero row
    ref = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = fused_experts(x, w13, w2, weights, ids)
    assert (out[0] == 0).all()
    _check(out, ref, dtype)


def test_weights_on_the_input_and_large_tiles():
    x, w13, w2, weights, ids = _case(50, 8, 1, 64, 32, torch.float32, seed=2)
    ref = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids,
                              apply_weights_on_input=True)
    big = FusedMoEKernelConfig(block_m=64, block_n=128, block_k=64)
    _check(fused_experts(x, w13, w2, weights, ids, apply_weights_on_input=True, cfg=big), ref, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("t, e, k, h, i", [(1, 8, 2, 4096, 512), (300, 128, 8, 2048, 768)])
def test_bf16_on_the_gpu(t, e, k, h, i):
    """bf16 dots (the interpreter has none): real expert widths, decode and prefill sizes."""
    x, w13, w2, weights, ids = _case(t, e, k, h, i, torch.bfloat16, seed=5)
    ref = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    _check(fused_experts(x, w13, w2, weights, ids), ref, torch.bfloat16)


def test_moe_align_sorts_and_pads_each_expert():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [3, 2]])
    sorted_ids, expert_ids, num_padded = moe_align(ids, num_experts=4, block_m=4)
    flat = ids.reshape(-1)
    used = int(num_padded)
    assert used == 4 * 4  # experts 0, 2, 3 and the -1 run: one 4-row block each
    blocks = sorted_ids[:used].view(-1, 4)
    for block, expert in zip(blocks, expert_ids[:used // 4].tolist()):
        real = block[block < flat.numel()]
        assert (flat[real] == expert).all() and real.tolist() == sorted(real.tolist())  # stable: token order
    assert sorted(sorted_ids[sorted_ids < flat.numel()].tolist()) == list(range(flat.numel()))
    assert expert_ids.tolist()[:4] == [0, 2, 3, -1] and set(expert_ids.tolist()[4:]) <= {-1}


def test_empty_batch():
    x, w13, w2, weights, ids = _case(0, 4, 2, 64, 32, torch.float32, seed=0)
    assert fused_experts(x, w13, w2, weights, ids).shape == (0, 64)


def test_warm_up_runs_the_large_batch_tiles(monkeypatch):
    """The start-up warm-up compiles the tiles a step of more than LARGE_BATCH_PAIRS pairs uses."""
    from pd_cluster.engine.attention.triton import fused_moe

    seen = []
    real = fused_moe._grouped_gemm
    monkeypatch.setattr(fused_moe, "_grouped_gemm", lambda *a: seen.append(a[10]) or real(*a))
    _, w13, w2, _, _ = _case(1, 4, 2, 64, 32, torch.float32, seed=0)
    fused_moe.warm_up(w13, w2, 2, torch.float32)
    assert seen and all(cfg == fused_moe.default_config(fused_moe.LARGE_BATCH_PAIRS + 1) for cfg in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpt_oss_biases_and_clamped_swiglu(dtype):
    """gpt-oss's experts: a bias after each product and the clamped SwiGLU (limit 1.5, inside the gate/up range
    here, so the clamps act); choices of other ranks (-1) still contribute nothing, bias included."""
    x, w13, w2, weights, ids = _case(37, 4, 2, 64, 32, dtype, seed=5, drop=0.3)
    ids[0] = -1
    gen = torch.Generator().manual_seed(9)
    b13 = torch.randn(4, 64, generator=gen).to(DEVICE, dtype)
    b2 = torch.randn(4, 64, generator=gen).to(DEVICE, dtype)
    act = ("swiglu_clamped", 1.702, 1.5)
    ref = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids, b13=b13.double(),
                              b2=b2.double(), activation=act)
    out = fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2, activation=act)
    assert (out[0] == 0).all()
    plain = torch_fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert (plain - ref).norm() > 0.1 * ref.norm()  # the biases and the activation matter here
    _check(out, ref, dtype)
