"""The async IO handle on Windows: no pread/pwrite and no O_DIRECT there, so each thread
reads and writes through its own handle with seek + readinto/write. Small requests only."""
from __future__ import annotations

import sys

import pytest
import torch

from shardwise.errors import StorageError
from shardwise.io import file_ops
from shardwise.io.aio_handle import AsyncIOHandle

pytestmark = pytest.mark.windows


def test_default_path_matches_the_platform():
    assert file_ops.default_positional() == (sys.platform != "win32")


@pytest.mark.parametrize("positional", [None, False], ids=["default", "seek"])
def test_round_trip_at_offsets_with_requests_in_flight(tmp_path, positional):
    gen = torch.Generator().manual_seed(0)
    h = AsyncIOHandle(1000, 2, False, True, 2, positional=positional)
    path = tmp_path / "win.bin"
    tensors = [torch.randn(n, generator=gen) for n in (1, 257, 3000)]
    offsets = [5, 100, 2000]
    for t, off in zip(tensors, offsets):
        h.async_pwrite(t, str(path), off)
    assert h.wait() == 3
    back = [torch.empty_like(t) for t in tensors]
    for t, off in zip(back, offsets):
        h.async_pread(t, str(path), off)
    assert h.wait() == 3
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    with pytest.raises(StorageError, match="win.bin"):
        h.sync_pread(torch.empty(10**6), str(path), 0)
    h.close()


def test_swap_store_round_trip_and_cleanup(tmp_path):
    from shardwise.io.swap import SwapDir, SwapStore, TensorSpec
    groups = [[TensorSpec("w", n, torch.float32)] for n in (10, 3000, 5)]
    store = SwapStore(SwapDir(tmp_path / "nvme", rank=0), groups, {"block_size": 4096}, buffer_count=3)
    for i, g in enumerate(groups):
        store.write_group(i, [torch.full((g[0].numel,), float(i))])
    store.stream(lambda i, views: views[0].add_(1))
    assert [store.read_group(i)[0][0].item() for i in range(3)] == [1.0, 2.0, 3.0]
    folder = store.dir.path
    store.close()
    assert not folder.exists()


def test_io_bench_json_runs_here(tmp_path, capsys):
    import json

    from shardwise.cli import main
    assert main(["io-bench", "--path", str(tmp_path), "--size", "256K", "--block-size", "64K",
                 "--threads", "1", "--queue-depth", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] is True and out["read_gbps"] > 0 and out["baseline_write_gbps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_open_descriptors_round_trip_and_validate(tmp_path):
    """DeepSpeed's async_pwrite / pread onto an open descriptor (``f.fileno()``): Windows has
    no pread/pwrite, so the requests take turns seeking one handle over the descriptor, which
    stays open, keeps the caller's position, and holds every byte where it was written."""
    gen = torch.Generator().manual_seed(1)
    h = AsyncIOHandle(512, 4, False, True, 4, positional=None if sys.platform == "win32" else False)
    tensors = [torch.randn(n, generator=gen) for n in (3, 700, 2500)]
    offsets = [0, 64, 4000]
    path = tmp_path / "fd.bin"
    with open(path, "w+b") as f:
        for t, off in zip(tensors, offsets):
            h.async_pwrite(t, f.fileno(), off)
        assert h.wait() == 3
        back = [torch.empty_like(t) for t in tensors]
        for t, off in zip(back, offsets):
            h.async_pread(t, f.fileno(), off)
        assert h.wait() == 3
        assert h.pwrite(tensors[0], f.fileno(), True, False, 0) == 1  # validate=True
        assert f.tell() == 0  # the caller's position, as after pwrite / pread
        assert len(f.read()) == 4000 + 2500 * 4  # the descriptor is still open
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))
    data = path.read_bytes()
    assert all(data[off:off + t.numel() * 4] == t.numpy().tobytes() for t, off in zip(tensors, offsets))
    h.close()
