"""KV store kernel against `KVPool.store_kv` (the reference quantiser).

fp16/fp32 pages must match bit for bit. FP8 pages: on a GPU bit for bit.
Under Triton's interpreter, whose fp32->fp8e4nv cast rounds differently from
the GPU's (triton #8322; the open fix, triton PR #11897, lists ties rounded
away from zero, subnormals rounded twice, and the carry dropped when rounding
overflows the mantissa, e.g. 126.24 -> 64 instead of 128, also seen here at
the subnormal boundary), random values are compared within one FP8 step, the
dropped carry (half the correct power of two) excepted and counted; and
values that are exact FP8 codes after scaling (power-of-two scales), where no
rounding happens, must match bit for bit there too. Slots -1 (padding) must
leave the pool untouched, and values past +-448 after scaling must saturate,
not become NaN.
"""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.triton.store import store_kv
from kernel_cases import device, make_pool

INTERPRETED = not torch.cuda.is_available()


def _fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance between two float8_e4m3fn tensors in representable steps (same-sign codes are ordered)."""
    ia, ib = a.view(torch.uint8).to(torch.int32), b.view(torch.uint8).to(torch.int32)
    sa, sb = ia >> 7, ib >> 7
    ma, mb = ia & 0x7F, ib & 0x7F
    same_sign = (ma - mb).abs()
    cross = ma + mb  # through zero
    return torch.where(sa == sb, same_sign, cross)


def _by_slot(kv: torch.Tensor) -> torch.Tensor:
    """The pool tensor indexed by slot: [(num_pages + 1) * page_size, layers, 2, heads, head_dim]."""
    p, layers, two, h, ps, d = kv.shape
    return kv.permute(0, 4, 1, 2, 3, 5).reshape(p * ps, layers, two, h, d)


def _interpreter_fp8_ok(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Codes within one step, or the interpreter's dropped carry: want is a power of two, got half of it."""
    g, w = got.float(), want.float()
    mantissa, _ = torch.frexp(w)
    dropped_carry = (mantissa.abs() == 0.5) & (g * 2 == w)
    return (_fp8_steps(got, want) <= 1) | dropped_carry, int(dropped_carry.sum())


def _case(kv, act: torch.dtype, page_size: int, num_kv_heads: int, head_dim: int, seed: int,
          exact_fp8: bool = False):
    gen = torch.Generator().manual_seed(seed)
    t = 23
    num_pages = max(4, -(-2 * t // page_size))
    scales = ((0.5, 2.0), (0.25, 4.0)) if exact_fp8 else None
    pool = make_pool(kv, num_kv_heads, head_dim, page_size, num_pages, act, gen, fp8_scales=scales)  # the poison
    ref = make_pool(kv, num_kv_heads, head_dim, page_size, num_pages, act, gen, fp8_scales=scales)
    ref.kv.copy_(pool.kv)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:t] + page_size  # never the null page
    slots[[3, 11, 17]] = -1  # padded batch slots
    slots = slots.to(device())
    k = (torch.randn(t, num_kv_heads, head_dim, generator=gen) * 3).to(device=device(), dtype=act)
    v = (torch.randn(t, num_kv_heads, head_dim, generator=gen) * 3).to(device=device(), dtype=act)
    if exact_fp8:  # exact FP8 codes times the (power-of-two) layer-1 scales: no rounding anywhere
        k = (k.float().to(torch.float8_e4m3fn).float() * 2.0).to(act)
        v = (v.float().to(torch.float8_e4m3fn).float() * 4.0).to(act)
    if kv == "fp8":
        k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 600.0, -460.0])  # saturate after the scale
    return pool, ref, k, v, slots


SHAPES = [(1, 2, 32), (16, 8, 8), (64, 3, 40)]  # (page_size, num_kv_heads, head_dim)


@pytest.mark.parametrize("kv", [torch.float16, torch.float32, "fp8"], ids=["fp16kv", "fp32kv", "fp8kv"])
@pytest.mark.parametrize("act", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("page_size,num_kv_heads,head_dim", SHAPES)
def test_store_matches_pool(kv, act, page_size, num_kv_heads, head_dim):
    _check_store(kv, act, page_size, num_kv_heads, head_dim, exact_fp8=False)


@pytest.mark.parametrize("act", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("page_size,num_kv_heads,head_dim", SHAPES)
def test_store_fp8_exact_codes(act, page_size, num_kv_heads, head_dim):
    """Inputs that are FP8 codes times power-of-two scales: bit for bit even under the interpreter."""
    _check_store("fp8", act, page_size, num_kv_heads, head_dim, exact_fp8=True)


def _check_store(kv, act, page_size, num_kv_heads, head_dim, exact_fp8):
    pool, ref, k, v, slots = _case(kv, act, page_size, num_kv_heads, head_dim, seed=page_size + head_dim,
                                   exact_fp8=exact_fp8)
    layer = 1
    before = _by_slot(pool.kv).clone()
    k_cache, v_cache = pool.layer_cache(layer)
    store_kv(k, v, k_cache, v_cache, slots, *pool.layer_scales(layer))
    ref.store_kv(layer, k, v, slots)  # the reference sends slot -1 to the null page; the kernel skips it
    got, want = _by_slot(pool.kv), _by_slot(ref.kv)
    ps = page_size
    assert torch.equal(got[:ps], before[:ps]), "padding (-1) slots must not write"
    written = torch.zeros(got.shape[0], dtype=torch.bool, device=got.device)
    written[slots[slots >= 0]] = True
    assert torch.equal(got[~written], before[~written]), "wrote outside the step's slots"
    assert not torch.equal(got[written], before[written])
    if kv != "fp8" or not INTERPRETED or exact_fp8:
        assert torch.equal(got[ps:], want[ps:])
    else:
        ok, dropped = _interpreter_fp8_ok(got[ps:].view(torch.float8_e4m3fn), want[ps:].view(torch.float8_e4m3fn))
        assert bool(ok.all()), f"{int((~ok).sum())} FP8 codes more than one step off"
        assert dropped < 0.05 * ok.numel()
    if kv == "fp8":
        assert not torch.isnan(got.view(torch.float8_e4m3fn).float()).any(), "FP8 NaN: no saturation"
    if kv == "fp8" and not exact_fp8:
        k_fp8 = k_cache.float()
        s0 = int(slots[0])
        sat = k_fp8[s0 // page_size, 0, s0 % page_size, :4]
        assert sat.tolist() == [448.0, -448.0, 448.0, -448.0]


def test_store_rejects_mismatched_shapes():
    pool, _, k, v, slots = _case(torch.float16, torch.float16, 16, 2, 32, seed=1)
    k_cache, v_cache = pool.layer_cache(0)
    with pytest.raises(ValueError):
        store_kv(k[:, :1], v[:, :1], k_cache, v_cache, slots, 1.0, 1.0)
