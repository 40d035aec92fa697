"""The NVMe swap folder (checked at creation, removed by close() and at exit) and the swap
store's pipelined sub-group streamer."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from shardwise.errors import ConfigError, StorageError
from shardwise.io import aio_handle, swap_dir
from shardwise.io.swap import GroupLayout, SwapDir, SwapStore, TensorSpec


def test_swap_dir_is_per_rank_and_run_and_removed_by_close(tmp_path):
    a = SwapDir(tmp_path / "nvme", rank=0, run_id="runA")
    b = SwapDir(tmp_path / "nvme", rank=1, run_id="runA")
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    assert a.path.parent == tmp_path / "nvme" / "shardwise_swap" and "rank00001" in b.path.name
    assert list(a.path.iterdir()) == []  # the probe file is gone
    a.file("x.swp").write_bytes(b"1")
    a.close()
    a.close()
    assert not a.path.exists() and a.closed and b.path.exists()
    b.close()
    assert list((tmp_path / "nvme").iterdir()) == []


def test_swap_dir_is_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        from shardwise.io.swap_dir import SwapDir
        d = SwapDir({str(tmp_path)!r}, rank=3)
        (d.path / "state.swp").write_bytes(b"x" * 10)
        print(d.path)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    made = out.stdout.strip()
    assert made.endswith("rank00003") and not os.path.exists(made)


@pytest.mark.parametrize("value", [None, "", "  "])
def test_missing_nvme_path_names_the_key(value, tmp_path):
    with pytest.raises(ConfigError, match=r"offload_param.nvme_path is not set.*\"nvme_path\""):
        SwapDir(value, key="offload_param.nvme_path")


def test_bad_paths_are_named(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StorageError, match=r"afile'.*is a regular file"):
        SwapDir(afile)
    with pytest.raises(StorageError, match=r"afile/sub'.*cannot be created"):
        SwapDir(afile / "sub")
    with pytest.raises(StorageError, match=r"too full: the swap files need .* GiB but .* is free"):
        SwapDir(tmp_path / "big", required_bytes=1 << 60)
    assert list((tmp_path / "big" / "shardwise_swap").glob("*")) == []  # a refused folder is removed

    real_open = os.open

    def refusing(code):
        def fake(path, flags, *a):
            if str(path).endswith(".probe"):
                raise OSError(code, os.strerror(code))
            return real_open(path, flags, *a)
        return fake

    monkeypatch.setattr(swap_dir.os, "open", refusing(errno.EROFS))
    with pytest.raises(StorageError, match=r"ro'.*is read-only"):
        SwapDir(tmp_path / "ro")
    monkeypatch.setattr(swap_dir.os, "open", refusing(errno.ENOSPC))
    with pytest.raises(StorageError, match=r"full'.*the disk is full"):
        SwapDir(tmp_path / "full")


def _groups():
    sizes = [1000, 4096, 7, 3333, 2500]
    return [[TensorSpec("master", n, torch.float32), TensorSpec("exp_avg", n, torch.bfloat16),
             TensorSpec("step", 1, torch.int64)] for n in sizes]


def test_layout_aligns_every_tensor():
    layout = GroupLayout.of(_groups()[0])
    assert layout.offsets == (0, 4096, 8192) and layout.nbytes == 12288
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    assert [v.dtype for v in views] == [torch.float32, torch.bfloat16, torch.int64]


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_stream_updates_every_group_and_overlaps_read_compute_write(tmp_path, monkeypatch, buffers):
    events = []
    for name, tag in (("read_request", "read"), ("write_request", "write")):
        real = getattr(aio_handle.AsyncIOHandle, name)

        def spy(self, buf, path, off=0, _real=real, _tag=tag):
            events.append((_tag, int(os.path.basename(str(path))[5:11])))
            return _real(self, buf, path, off)
        monkeypatch.setattr(aio_handle.AsyncIOHandle, name, spy)
    groups = _groups()
    store = SwapStore(SwapDir(tmp_path, run_id="s"), groups,
                      {"block_size": 4096, "queue_depth": 2, "intra_op_parallelism": 2},
                      buffer_count=buffers)
    gen = torch.Generator().manual_seed(0)
    initial = [[torch.randn(s.numel, generator=gen).to(s.dtype) for s in g] for g in groups]
    for i, tensors in enumerate(initial):
        store.write_group(i, tensors)
    ptrs = set()

    def step(i, views):
        events.append(("fn", i))
        ptrs.add(views[0].data_ptr())
        views[0].add_(1)
        views[1].mul_(2)
        views[2].add_(i)
    store.stream(step)
    n = len(groups)
    assert [e for e in events if e[0] == "fn"] == [("fn", i) for i in range(n)]
    assert len(ptrs) == buffers  # the ring is reused, never grown
    at = {e: k for k, e in enumerate(events)}
    for i in range(n):
        if i + 1 < n:
            assert at[("read", i + 1)] < at[("fn", i)]  # i+1 is read while i is processed
        if i >= 1 and buffers >= 3:
            assert at[("write", i - 1)] < at[("fn", i)]  # ... and i-1 written back meanwhile
    for i, want in enumerate(initial):
        got = store.read_group(i)
        assert torch.equal(got[0], want[0] + 1) and torch.equal(got[1], want[1] * 2)
        assert torch.equal(got[2], want[2] + i)
    store.stream(lambda i, v: None, order=[3, 1], write_back=False)
    path = store.dir.path
    store.close()
    assert not path.exists()


def test_store_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"buffer_count = 1"):
        SwapStore(SwapDir(tmp_path, run_id="e1"), _groups(), buffer_count=1)
    store = SwapStore(SwapDir(tmp_path, run_id="e2"), _groups())
    with pytest.raises(StorageError, match="group 0 was never written"):
        store.stream(lambda i, v: None)
    with pytest.raises(StorageError, match="master has 5 elements"):
        store.write_group(0, [torch.zeros(5), torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1)])
    store.close()


def test_host_memory_stays_flat_over_300_streamed_steps(tmp_path):
    """300 optimizer-like steps over 4 swapped groups: every value updated each step, and
    the process's resident memory does not grow (no per-request leak of buffers, files or
    bookkeeping)."""
    groups = [[TensorSpec("m", 20000, torch.float32)] for _ in range(4)]
    store = SwapStore(SwapDir(tmp_path, run_id="rss"), groups, {"block_size": 65536}, buffer_count=3)
    for i in range(4):
        store.write_group(i, [torch.zeros(20000)])
    proc = psutil.Process()
    rss = []
    for step in range(300):
        store.stream(lambda i, views: views[0].add_(1))
        if step in (49, 299):
            rss.append(proc.memory_info().rss)
    assert all(torch.equal(store.read_group(i)[0], torch.full((20000,), 300.0)) for i in range(4))
    assert rss[1] - rss[0] < 8 * 2**20
    store.close()
