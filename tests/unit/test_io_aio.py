"""The async IO handle (shardwise.io.aio_handle) against plain file reads and writes.

Every test compares the bytes that went through the handle with bytes written or read by
ordinary Python file IO: random offsets, sizes that are not multiples of the block or of the
page, pinned/aligned and ordinary tensors, many requests in flight, the O_DIRECT path (with
aligned and unaligned buffers), the buffered fallback, the per-thread-handle path that
Windows uses, and the errors.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import warnings

import pytest
import torch

from shardwise.errors import StorageError
from shardwise.io import file_ops
from shardwise.io.aio_handle import AsyncIOHandle
from shardwise.io.aligned import ALIGN
from shardwise.io.file_ops import Block, plan_blocks
from shardwise.ops.op_builder import AsyncIOBuilder


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _file_bytes(path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


@pytest.mark.parametrize("positional", [True, False], ids=["pread", "seek"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_random_offsets_and_sizes_round_trip(tmp_path, positional, direct):
    if positional and not file_ops.HAS_POSITIONAL:
        pytest.skip("no os.preadv on this OS")
    rng = random.Random(0)
    path = tmp_path / "data.bin"
    with AsyncIOHandle(8192, 4, False, True, 2, direct=direct, positional=positional) as h:
        # 40 disjoint requests in flight at once: odd sizes at odd and aligned offsets
        spans, pos = [], 0
        for i in range(40):
            pos += rng.choice([0, 1, 511, ALIGN - 3, ALIGN])
            n = rng.choice([1, 100, 4095, ALIGN, 3 * ALIGN + 17, 8192, 30_001])
            spans.append((pos, n))
            pos += n
        data = [_random_bytes(n, i) for i, (_, n) in enumerate(spans)]
        for (off, _), t in zip(spans, data):
            assert h.async_pwrite(t, str(path), off) == 0
        assert h.wait() == len(spans)
        for (off, n), t in zip(spans, data):
            assert _file_bytes(path, off, n) == t.numpy().tobytes()
        back = [torch.empty_like(t) for t in data]
        for (off, _), t in zip(spans, back):
            h.async_pread(t, path, off)  # a Path works too
        assert h.wait() == len(spans)
        for want, got in zip(data, back):
            assert torch.equal(want, got)


def test_pinned_aligned_and_unaligned_tensors_of_many_dtypes(tmp_path, monkeypatch):
    bounced = []
    real_bounce = file_ops._bounce
    monkeypatch.setattr(file_ops, "_bounce", lambda n: bounced.append(n) or real_bounce(n))
    path = str(tmp_path / "t.bin")
    h = AsyncIOBuilder().load().aio_handle(ALIGN * 2, 8, False, True, 2)
    pinned = h.new_cpu_locked_tensor(50_000, torch.empty(0, dtype=torch.bfloat16))
    assert pinned.dtype == torch.bfloat16 and pinned.numel() == 50_000
    assert pinned.data_ptr() % h.get_alignment() == 0
    pinned.copy_(torch.randn(50_000))
    plain = torch.randn(70_001, dtype=torch.float64)
    odd = _random_bytes(40_000, 1)[3:]  # an address off the page: the bounce path under O_DIRECT
    mask = torch.rand(1000) > 0.5
    offsets = [0, 100_000, 100_000 + 8 * 70_001, 2 * ALIGN * 200]
    for t, off in zip([pinned, plain, odd, mask], offsets):
        assert h.sync_pwrite(t, path, off) == 1
    for t, off in zip([pinned, plain, odd, mask], offsets):
        got = torch.empty_like(t)
        assert h.sync_pread(got, path, off) == 1
        assert torch.equal(got, t)
    # under O_DIRECT the tensor off the page boundary went through the aligned bounce buffer
    assert bool(bounced) == (file_ops.HAS_O_DIRECT and not h.direct_refused)
    h.close()


def test_blocks_cover_the_request_and_direct_blocks_are_aligned():
    rng = random.Random(1)
    for _ in range(200):
        off, n = rng.randrange(0, 3 * ALIGN), rng.randrange(1, 40 * ALIGN)
        bs = rng.choice([1000, ALIGN, 3 * ALIGN + 5, 1 << 20])
        for direct in (True, False):
            blocks = plan_blocks(off, n, bs, direct)
            assert [b.buf_offset for b in blocks] == [0] + [b.buf_offset + b.length for b in blocks[:-1]]
            assert sum(b.length for b in blocks) == n
            assert all(b.file_offset == off + b.buf_offset and b.length > 0 for b in blocks)
            for b in blocks:
                if b.direct:
                    assert b.file_offset % ALIGN == 0 and b.length % ALIGN == 0
            if not direct:
                assert all(b.length <= bs and not b.direct for b in blocks)
    assert plan_blocks(ALIGN, 3 * ALIGN, 1 << 20, True) == [Block(ALIGN, 0, 3 * ALIGN, True)]


@pytest.mark.skipif(not file_ops.HAS_O_DIRECT, reason="O_DIRECT is Linux-only")
def test_aligned_blocks_use_o_direct_where_the_filesystem_allows(tmp_path, monkeypatch):
    opened = []
    real_open = os.open
    monkeypatch.setattr(file_ops.os, "open", lambda p, flags, *a: opened.append(flags) or real_open(p, flags, *a))
    h = AsyncIOHandle(ALIGN * 4, 2, False, True, 1)
    t = _random_bytes(10 * ALIGN + 5, 2)
    h.sync_pwrite(t, tmp_path / "d.bin", 0)
    if h.direct_refused:
        pytest.skip(f"{tmp_path} refuses O_DIRECT (covered by the fallback test)")
    assert any(flags & os.O_DIRECT for flags in opened)
    got = torch.empty_like(t)
    h.sync_pread(got, tmp_path / "d.bin", 0)
    assert torch.equal(got, t)


@pytest.mark.skipif(not file_ops.HAS_O_DIRECT, reason="O_DIRECT is Linux-only")
def test_refused_o_direct_falls_back_to_buffered_with_one_log_line(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(file_ops.os, "open", no_direct)
    logger = logging.getLogger("shardwise")
    monkeypatch.setattr(logger, "propagate", True)
    h = AsyncIOHandle(ALIGN, 4, False, True, 2)
    t = _random_bytes(20 * ALIGN, 3)
    with caplog.at_level(logging.INFO, logger="shardwise"):
        for i in range(3):
            h.sync_pwrite(t, tmp_path / f"f{i}.bin", 0)
    lines = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(lines) == 1 and "f0.bin" in lines[0] and "buffered" in lines[0]
    assert h.direct_refused
    got = torch.empty_like(t)
    h.sync_pread(got, tmp_path / "f2.bin", 0)
    assert torch.equal(got, t)


def test_deepspeed_surface(tmp_path):
    """The constructor, getters and method names of DeepSpeed's aio_handle and aio ops."""
    from shardwise.ops import aio
    assert AsyncIOBuilder().is_compatible() and AsyncIOBuilder.NAME == "async_io"
    h = aio.aio_handle(1024, 2, True, False, 2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(),
            h.get_overlap_events(), h.get_intra_op_parallelism()) == (1024, 2, True, False, 2)
    defaults = aio.aio_handle()
    assert (defaults.get_block_size(), defaults.get_queue_depth()) == (1 << 20, 128)
    src = _random_bytes(4096, 4)
    path = str(tmp_path / "ds.bin")
    assert h.pwrite(src, path, False, **{"async": True}) == 0
    assert h.wait() == 1
    dst = torch.empty_like(src)
    assert h.pread(dst, path, True, False, 0) == 1  # validate=True compares with the file
    assert torch.equal(dst, src)
    assert aio.aio_write(src, path, 1024, 2, False, True, True) == 0
    dst.zero_()
    assert aio.aio_read(dst, path, 1024, 2, False, True, True) == 0 and torch.equal(dst, src)
    assert h.wait() == 0  # nothing pending
    with open(path, "r+b") as f:  # DeepSpeed's async_pwrite onto an open descriptor
        h.async_pwrite(src.flip(0), f.fileno(), 0)
        assert h.wait() == 1
    assert _file_bytes(path, 0, 4096) == src.flip(0).numpy().tobytes()


def test_gds_builder_surface(tmp_path, monkeypatch):
    """DeepSpeed's GDSBuilder/gds_handle: without kvikio a warning and the host path."""
    from shardwise.io import aio_handle
    from shardwise.ops.op_builder import GDSBuilder
    monkeypatch.setattr(aio_handle, "kvikio_module", lambda: None)
    with pytest.warns(UserWarning, match="kvikio is not installed"):
        h = GDSBuilder().load().gds_handle(4096, 4, False, True, 1)
    assert h.get_queue_depth() == 4 and h.pin_device_tensor(torch.zeros(1))
    t = _random_bytes(10_000, 9)
    assert h.sync_pwrite(t, str(tmp_path / "g.bin"), 0) == 1
    got = torch.empty_like(t)
    assert h.sync_pread(got, str(tmp_path / "g.bin"), 0) == 1 and torch.equal(got, t)


def test_errors_name_the_file(tmp_path):
    h = AsyncIOHandle(1024, 2, False, True, 1)
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(StorageError, match=r"short.bin: reading 200 bytes at offset 0 .* file has 100"):
        h.sync_pread(torch.empty(200, dtype=torch.uint8), path, 0)
    with pytest.raises(StorageError, match="missing.bin"):
        h.async_pread(torch.empty(10, dtype=torch.uint8), tmp_path / "missing.bin", 0)
    with pytest.raises(StorageError, match="not contiguous"):
        h.sync_pwrite(torch.zeros(8, 8).t(), tmp_path / "nc.bin", 0)
    with pytest.raises(StorageError, match="no_dir"):
        h.sync_pwrite(torch.zeros(8), tmp_path / "no_dir" / "x.bin", 0)
    with pytest.raises(StorageError, match="block_size=0"):
        AsyncIOHandle(0, 8)
    # a failure inside a worker thread surfaces at wait(), after the other requests finished
    good = _random_bytes(5000, 5)
    h.async_pwrite(good, tmp_path / "good.bin", 0)
    bad = tmp_path / "shrinks.bin"
    bad.write_bytes(b"y" * 5000)
    h.async_pwrite(good, tmp_path / "good2.bin", 0)
    assert h.wait() == 2
    target = torch.empty(5000, dtype=torch.uint8)
    real_move = file_ops.RequestFiles.move

    def shrink_then_move(self, block, address, view):
        os.truncate(bad, 10)
        return real_move(self, block, address, view)

    file_ops.RequestFiles.move = shrink_then_move
    try:
        h.async_pread(target, bad, 0)
        with pytest.raises(StorageError, match="shrinks.bin: the file ended"):
            h.wait()
    finally:
        file_ops.RequestFiles.move = real_move
    assert h.wait() == 0
    assert _file_bytes(tmp_path / "good2.bin", 0, 5000) == good.numpy().tobytes()


def test_use_gds_without_kvikio_warns_and_uses_threads(tmp_path, monkeypatch):
    from shardwise.io import aio_handle
    monkeypatch.setattr(aio_handle, "kvikio_module", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = AsyncIOHandle(4096, 2, use_gds=True)
    assert any("kvikio is not installed" in str(w.message) and "pip install" in str(w.message)
               for w in caught)
    t = _random_bytes(9000, 6)
    h.sync_pwrite(t, tmp_path / "g.bin", 0)
    got = torch.empty_like(t)
    h.sync_pread(got, tmp_path / "g.bin", 0)
    assert torch.equal(got, t)


@pytest.mark.skipif(not file_ops.HAS_O_DIRECT, reason="O_DIRECT (and fallocate) are Linux-only")
def test_extending_direct_writes_are_preallocated_and_keep_existing_bytes(tmp_path, monkeypatch):
    calls = []
    real = file_ops._fallocate()
    assert real is not None
    monkeypatch.setattr(file_ops, "_fallocate", lambda: lambda *a: calls.append(a[1:]) or real(*a))
    path = tmp_path / "p.bin"
    path.write_bytes(b"\x01" * 10_000)
    h = AsyncIOHandle(ALIGN, 4, False, True, 2)
    t = _random_bytes(5 * ALIGN, 8)
    h.sync_pwrite(t, path, 2 * ALIGN)  # extends the file: allocated first
    h.sync_pwrite(t[:ALIGN], path, 0)  # inside the file: nothing to allocate
    if h.direct_refused:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert calls == [(0, 2 * ALIGN, 5 * ALIGN)]
    data = path.read_bytes()
    assert len(data) == 7 * ALIGN and data[ALIGN:2 * ALIGN] == b"\x01" * ALIGN
    assert data[:ALIGN] == t[:ALIGN].numpy().tobytes() and data[2 * ALIGN:] == t.numpy().tobytes()


def test_open_descriptors_work_without_pread_and_pwrite(tmp_path, monkeypatch):
    """Windows on Linux: with no os.preadv/os.pwritev, the Windows job's descriptor test
    passes here too (DeepSpeed's async_pwrite onto ``f.fileno()`` called os.pwritev and
    failed)."""
    from tests.windows.test_io_windows import test_open_descriptors_round_trip_and_validate as body
    monkeypatch.delattr(os, "preadv")
    monkeypatch.delattr(os, "pwritev")
    monkeypatch.setattr(file_ops, "HAS_POSITIONAL", False)
    body(tmp_path)


def test_validate_reads_an_open_descriptor_back_and_keeps_its_position(tmp_path):
    """DeepSpeed's pwrite/pread(validate=True) onto an open descriptor compares with what that
    descriptor's file holds (it opened the name "<fd N>" and failed), and leaves the caller's
    file position where it was."""
    from shardwise.ops import aio
    h = aio.aio_handle(1024, 2, True, False, 2)
    src = _random_bytes(3000, 7)
    with open(tmp_path / "v.bin", "w+b") as f:
        f.write(b"x" * 10)
        assert h.pwrite(src, f.fileno(), True, False, 100) == 1
        dst = torch.empty_like(src)
        assert h.pread(dst, f.fileno(), True, False, 100) == 1
        assert f.tell() == 10
    assert torch.equal(dst, src)
