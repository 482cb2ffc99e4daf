"""`pd_cluster.engine.graph`: buckets, bucket choice, static-buffer filling and padding (CPU), capture and replay (GPU)."""

from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.attention.triton_backend import TritonAttentionBackend
from pd_cluster.engine.graph import (PAD_SEQ_LEN, CaptureBuffers, CudaGraphConfig, CudaGraphRunner, capture_batch_sizes,
                          maybe_capture_decode_graphs, select_bucket)
from kernel_cases import device, make_batch


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 4 + 16
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_select_bucket():
    sizes = [1, 2, 4, 8, 16, 32]
    assert [select_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert select_bucket(33, sizes) is None


def test_fill_copies_and_pads():
    gen = torch.Generator().manual_seed(0)
    bufs = CaptureBuffers.allocate(max_bs=8, max_pages=6, device=device())
    bufs.block_tables.fill_(77)  # stale rows from an earlier, larger step
    bufs.slot_mapping.fill_(55)
    batch = make_batch([(10, 1), (40, 1), (0, 1)], 3, 16, 20, gen)
    bufs.fill(batch, 4)
    assert torch.equal(bufs.input_ids[:3], batch.input_ids)
    assert torch.equal(bufs.positions[:3], batch.positions)
    assert torch.equal(bufs.slot_mapping[:3], batch.slot_mapping)
    assert torch.equal(bufs.seq_lens[:3], batch.seq_lens)
    w = batch.block_tables.shape[1]
    assert torch.equal(bufs.block_tables[:3, :w], batch.block_tables)
    # padding row 3: slot -1 (store skipped), null page, seq_len 1, position 0, logits row 3
    assert bufs.slot_mapping[3].item() == -1 and bufs.seq_lens[3].item() == PAD_SEQ_LEN
    assert bufs.block_tables[3].tolist() == [0] * 6 and bufs.positions[3].item() == 0
    assert bufs.logits_indices[:4].tolist() == [0, 1, 2, 3]
    view = bufs.batch_view(4)
    assert view.num_decodes == 4 and view.is_decode_only and view.num_tokens == 4
    assert view.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert view.block_tables.data_ptr() == bufs.block_tables.data_ptr()  # a slice, not a copy


def test_fill_rejects_what_it_cannot_hold():
    gen = torch.Generator().manual_seed(1)
    bufs = CaptureBuffers.allocate(max_bs=4, max_pages=2, device=device())
    mixed = make_batch([(3, 1), (0, 5)], 1, 16, 8, gen)
    with pytest.raises(ValueError):
        bufs.fill(mixed, 4)
    too_long = make_batch([(70, 1)], 1, 16, 8, gen)  # 5 pages > 2
    with pytest.raises(ValueError):
        bufs.fill(too_long, 4)


def test_runner_requires_graph_safe_backend():
    from pd_cluster.engine.kv.pool import KVLayout, KVPool
    layout = KVLayout(1, 2, 16, 16, "fp16", (1.0,), (1.0,))
    pool = KVPool(layout, 4, device(), torch.float16)
    with pytest.raises(ValueError, match="cannot be captured"):
        CudaGraphRunner(torch.nn.Identity(), pool, TorchAttentionBackend(4, 2, 16, 0.25), CudaGraphConfig(max_bs=4))
    if device().type == "cpu":
        tri = TritonAttentionBackend(4, 2, 16, 0.25)
        assert maybe_capture_decode_graphs(torch.nn.Identity(), pool, tri, CudaGraphConfig(max_bs=4)) is None


def test_can_run():
    from pd_cluster.engine.kv.pool import KVLayout, KVPool
    gen = torch.Generator().manual_seed(2)
    layout = KVLayout(1, 2, 16, 16, "fp16", (1.0,), (1.0,))
    pool = KVPool(layout, 40, device(), torch.float16)
    runner = CudaGraphRunner(torch.nn.Identity(), pool, TritonAttentionBackend(4, 2, 16, 0.25),
                             CudaGraphConfig(max_bs=4, max_context_len=64))
    assert runner.sizes == [1, 2, 4] and runner.buffers.max_pages == 4
    assert runner.can_run(make_batch([(5, 1)] * 4, 4, 16, 40, gen))
    assert not runner.can_run(make_batch([(5, 1)] * 5, 5, 16, 40, gen))  # over max_bs
    assert not runner.can_run(make_batch([(5, 1), (0, 3)], 1, 16, 40, gen))  # has a prefill
    assert not runner.can_run(make_batch([(70, 1)], 1, 16, 40, gen))  # longer than captured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
def test_decode_step_makes_no_host_sync():
    """Graph replay, and an eager Triton decode step, run under torch's sync debug mode set to error."""
    from pd_cluster.engine.assets import DEFAULT_MODEL
    from pd_cluster.engine.model.loader import load_model
    from greedy_driver import make_pool_for
    loaded = load_model(DEFAULT_MODEL, "float32", device="cuda")
    a = loaded.arch
    backend = TritonAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5)
    pool = make_pool_for(loaded, "fp8_e4m3", 16, 64, torch.device("cuda"))
    runner = CudaGraphRunner(loaded.model, pool, backend, CudaGraphConfig(max_bs=8, max_context_len=256))
    runner.capture()
    batch = make_batch([(30, 1), (77, 1), (5, 1)], 3, 16, 64, torch.Generator().manual_seed(4))
    want = loaded.model(batch, pool, backend).clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = runner.replay(batch)
        eager = loaded.model(batch, pool, backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(eager, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_pages, max_bs, width", [
    (40, 2, 40),                # every page of the pool: no request can hold more
    (200_000, 256, 65536),      # capped at 64 MiB of int32 (1M tokens at page 16)
    (200_000, 8, 200_000),      # a small batch: the whole pool within 64 MiB
])
def test_default_graph_width_is_the_pool_within_64_mib_and_wider_decodes_run_eagerly(num_pages, max_bs, width):
    """The static block table covers as many pages as the pool holds, capped at GRAPH_TABLE_BYTES, whatever
    --context-length is (the engine builds its config without it); a decode batch past it is refused by
    `can_run` and so runs eagerly."""
    import numpy as np
    from pd_cluster.engine.batch import build_forward_batch
    from pd_cluster.engine.graph import GRAPH_TABLE_BYTES, graph_table_pages
    assert graph_table_pages(max_bs, num_pages) == width and width * max_bs * 4 <= GRAPH_TABLE_BYTES
    if num_pages > 1000:
        return  # the rule only: no pool of that size here
    from pd_cluster.engine.kv.pool import KVLayout, KVPool
    pool = KVPool(KVLayout(1, 2, 16, 16, "fp16", (1.0,), (1.0,)), num_pages, device(), torch.float16)
    runner = CudaGraphRunner(torch.nn.Identity(), pool, TritonAttentionBackend(4, 2, 16, 0.25),
                             CudaGraphConfig(max_bs=max_bs, eager_stand_in=True))
    assert runner.buffers.block_tables.shape == (max_bs, width)

    def decode_at(ctx: int):
        pages = [1] * -(-(ctx + 1) // 16)
        return build_forward_batch([np.array([3])], [ctx], [pages], [np.array([0])], 1, 16, device())

    assert runner.can_run(decode_at(width * 16 - 1))  # exactly `width` pages
    assert not runner.can_run(decode_at(width * 16))  # one page more
