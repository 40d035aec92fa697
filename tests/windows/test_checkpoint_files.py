"""Checkpoint files on Windows: atomic replace, ':'-free names, open-handle rules.

The checkpoint writer relies on ``os.replace`` (``os.rename`` onto an existing file raises
FileExistsError on Windows) and on names Windows accepts. Under Wine the Windows rules for
renames and open handles hold as on real Windows; one thing Wine does not copy is NTFS's
refusal of ':' in names (the host filesystem takes it), so the ':' rule is checked through
the library's own validation rather than by the OS.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.windows._helpers import ON_WINDOWS

pytestmark = pytest.mark.windows


def _temps(folder: Path) -> list:
    import shardwise.checkpoint.atomic as atomic
    return [p.name for p in folder.iterdir() if atomic.TMP_MARKER in p.name]


def test_atomic_write_replaces_an_existing_file(tmp_path: Path) -> None:
    import shardwise.checkpoint.atomic as atomic
    target = tmp_path / "latest"
    target.write_bytes(b"global_step10")
    # The platform behaviour the helper exists for: a plain rename cannot overwrite on Windows.
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    if ON_WINDOWS:
        with pytest.raises(FileExistsError):
            os.rename(probe, target)
    atomic.atomic_write_bytes(target, b"global_step20")
    assert target.read_bytes() == b"global_step20"
    atomic.atomic_write_text(str(target), "global_step30")  # a str path with backslashes on Windows
    assert target.read_text(encoding="utf-8") == "global_step30"
    assert _temps(tmp_path) == []


def test_atomic_open_failure_keeps_the_old_file(tmp_path: Path) -> None:
    import shardwise.checkpoint.atomic as atomic
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.atomic_open(target) as f:
            f.write(b"half-written")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    # The temporary file was closed before it was deleted (Windows refuses to delete open files).
    assert _temps(tmp_path) == []


def test_replacing_a_file_another_handle_holds_open(tmp_path: Path) -> None:
    """Windows (and Wine) refuse to replace a file that is open elsewhere; the writer must
    fail loudly, leave the old file intact and clean up its temporary file."""
    import shardwise.checkpoint.atomic as atomic
    target = tmp_path / "rank00000-of-00001.safetensors"
    target.write_bytes(b"old")
    import shardwise.errors as errors
    with open(target, "rb"):
        if ON_WINDOWS:
            with pytest.raises((OSError, errors.CheckpointError)):
                atomic.atomic_write_bytes(target, b"new")
            assert target.read_bytes() == b"old"
        else:
            atomic.atomic_write_bytes(target, b"new")
    assert _temps(tmp_path) == []
    atomic.atomic_write_bytes(target, b"new")  # once the handle is closed it works everywhere
    assert target.read_bytes() == b"new"


def test_names_with_colons_are_rejected(tmp_path: Path) -> None:
    import shardwise.checkpoint.atomic as atomic
    import shardwise.checkpoint.format as fmt
    import shardwise.errors as errors
    with pytest.raises(errors.CheckpointError, match="':'"):
        atomic.atomic_write_bytes(tmp_path / "step:10.json", b"{}")
    assert list(tmp_path.iterdir()) == []
    for bad in ("global_step:10", "2026-12-02T16:30:00", "a\\b", "a/b", "CON", "step10."):
        with pytest.raises(errors.CheckpointError):
            fmt.validate_tag(bad)
    assert fmt.validate_tag("global_step10") == "global_step10"


def test_generated_names_are_valid_windows_names(tmp_path: Path) -> None:
    import shardwise.checkpoint.format as fmt
    import shardwise.checkpoint.atomic as atomic
    names = [fmt.rank_file_stem(r, 8) for r in range(8)]
    names.append(atomic.temp_name_for(tmp_path / "shardwise_meta.json").name)
    for name in names:
        assert not set(name) & set(':*?"<>|\\/'), name
        (tmp_path / name).write_bytes(b"x")  # really creatable here
    assert sorted(names[:8]) == names[:8]  # zero-padded, so they sort by rank


def test_safetensors_roundtrip_on_a_drive_letter_path(tmp_path: Path) -> None:
    import torch
    import shardwise.checkpoint.format as fmt
    path = tmp_path / "global_step10" / (fmt.rank_file_stem(0, 2) + ".safetensors")
    if ON_WINDOWS:
        assert str(path)[1] == ":"  # a real drive-letter path (Z: under Wine)
    weights = torch.randn(3, 5)
    master = torch.arange(7, dtype=torch.float32)
    record = fmt.write_safetensors(str(path), [
        fmt.TensorItem(key="weight/fc.weight/0", dtype=weights.dtype, shape=tuple(weights.shape), source=weights),
        fmt.TensorItem(key="master/fc.bias/0", dtype=master.dtype, shape=(7,), source=lambda: master),
    ])
    with fmt.SliceFileReader(path, record) as reader:
        assert torch.equal(reader.read("weight/fc.weight/0"), weights)
        assert torch.equal(reader.read("master/fc.bias/0"), master)
    # The reader closed its handle, so the same file can be rewritten in place (Windows rule).
    record2 = fmt.write_safetensors(path, [
        fmt.TensorItem(key="master/fc.bias/0", dtype=master.dtype, shape=(7,), source=master * 2)])
    with fmt.SliceFileReader(path, record2) as reader:
        assert torch.equal(reader.read("master/fc.bias/0"), master * 2)
    assert _temps(path.parent) == []


def test_chunk_parallel_reads_release_every_handle(tmp_path: Path, monkeypatch) -> None:
    """A tensor of several crc chunks is read on worker threads, each through its own handle;
    closing the reader must close all of them, or Windows refuses the rewrite that follows."""
    import torch
    import shardwise.checkpoint.format as fmt
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256)
    monkeypatch.setattr(fmt, "_read_workers", lambda: 4)
    path = tmp_path / "rank00000-of-00001.safetensors"
    value = torch.randn(1000)
    record = fmt.write_safetensors(path, [fmt.TensorItem("t", torch.float32, [1000], value)])
    with fmt.SliceFileReader(path, record) as reader:
        assert torch.equal(reader.read("t"), value)
    record = fmt.write_safetensors(path, [fmt.TensorItem("t", torch.float32, [1000], value * 3)])
    with fmt.SliceFileReader(path, record) as reader:
        assert torch.equal(reader.read("t"), value * 3)
    assert _temps(tmp_path) == []
