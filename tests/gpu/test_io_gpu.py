"""The async IO handle and the swap store with CUDA tensors: reads and writes of device
memory go through a pinned bounce buffer (or kvikio with use_gds when it is installed) and
come back exact; pinned buffers from new_cpu_locked_tensor are really pinned."""
from __future__ import annotations

import warnings

import pytest
import torch

from shardwise.io.aio_handle import AsyncIOHandle
from shardwise.io.gds import kvikio_module
from shardwise.io.swap import SwapDir, SwapStore, TensorSpec
from shardwise.ops.op_builder import AsyncIOBuilder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_tensors_round_trip_through_the_handle(tmp_path):
    h = AsyncIOBuilder().load().aio_handle(1 << 20, 8, False, True, 2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(3 * (1 << 20) + 11, device="cuda", generator=gen).bfloat16()
    assert h.sync_pwrite(src, str(tmp_path / "d.bin"), 4096) == 1
    dst = torch.empty_like(src)
    assert h.async_pread(dst, str(tmp_path / "d.bin"), 4096) == 0
    assert h.wait() == 1 and torch.equal(dst, src)
    pinned = h.new_cpu_locked_tensor(1000, torch.empty(0))
    assert h.is_pinned(pinned) and pinned.data_ptr() % h.get_alignment() == 0


def test_use_gds_round_trip(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = AsyncIOHandle(1 << 20, 8, use_gds=True)
    if kvikio_module() is None:
        assert any("kvikio is not installed" in str(w.message) for w in caught)
    src = torch.arange(5 * (1 << 20), device="cuda", dtype=torch.float32)
    h.sync_pwrite(src, str(tmp_path / "g.bin"), 0)
    dst = torch.zeros_like(src)
    h.sync_pread(dst, str(tmp_path / "g.bin"), 0)
    assert torch.equal(dst, src)


def test_swap_store_streams_to_the_device_and_back(tmp_path):
    groups = [[TensorSpec("master", n, torch.float32)] for n in (1 << 20, 12345, 1 << 18)]
    store = SwapStore(SwapDir(tmp_path), groups, {"block_size": 1 << 20}, buffer_count=3)
    for i, g in enumerate(groups):
        store.write_group(i, [torch.full((g[0].numel,), float(i), device="cuda")])

    def step(i, views):
        on_device = views[0].to("cuda", non_blocking=True)
        on_device.mul_(10)
        views[0].copy_(on_device)  # back into the pinned buffer before it is written
    store.stream(step)
    assert [float(store.read_group(i)[0][-1]) for i in range(3)] == [0.0, 10.0, 20.0]
    store.close()
