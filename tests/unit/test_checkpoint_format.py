"""The checkpoint format without an engine: streaming safetensors writer/reader, checksums,
tags, atomic writes, JSON encoding, and resharding through synthetic ShardViews.

``FakeEngine`` below splits each parameter of a small module into ``world`` flat slices the
way a ZeRO strategy would, with a real torch Adam stepping fp32 masters, so a checkpoint
"written by 3 ranks" can be produced and read back at other world sizes in one process.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import zlib
from pathlib import Path
from typing import List

import pytest
import torch
from safetensors import safe_open

from shardwise.checkpoint import CheckpointReader, atomic_open, atomic_write_bytes, validate_tag
from shardwise.checkpoint import engine_io
from shardwise.checkpoint.contract import CheckpointSettings
from shardwise.checkpoint.consolidate import get_fp32_state_dict
from shardwise.checkpoint.engine_io import load_checkpoint
from shardwise.checkpoint.format import (META_FILE, SliceFileReader, TensorItem, chunk_crcs,
                                         from_jsonable, to_jsonable, write_safetensors)
from shardwise.errors import CheckpointError
from shardwise.zero.shard_view import ShardView


# --------------------------------------------------------------------------- fakes


class _Opt:
    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.loss_scaler = None


class FakeEngine:
    """The engine contract of shardwise.checkpoint, for rank ``rank`` of ``world`` (no dist)."""

    def __init__(self, module: torch.nn.Module, rank: int, world: int,
                 weight_dtype: torch.dtype = torch.float32, lr: float = 1e-2) -> None:
        self.module, self.global_rank, self.world_size = module, rank, world
        self.dp_group, self.config, self.lr_scheduler, self.training_dataloader = None, None, None, None
        self.loss_scaler, self.pending_save = None, None
        self.device = torch.device("cpu")
        self.global_steps, self.global_samples, self.micro_steps, self.skipped_steps = 0, 0, 0, 0
        self.refreshed: List[bool] = []
        for p in module.parameters():  # params only: buffers keep their dtype
            p.data = p.data.to(weight_dtype)
        self._views = []
        for name, p in module.named_parameters():
            n = p.numel()
            lo, hi = n * rank // world, n * (rank + 1) // world
            weight = p.data.view(-1)[lo:hi]
            master = weight.detach().float().clone() if p.requires_grad else None
            self._views.append(ShardView(name, p, p.shape, lo, hi, weight, master))
        masters = [v.master for v in self._views if v.master is not None]
        self.optimizer = _Opt(torch.optim.Adam(masters, lr=lr))

    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings()

    def zero_optimization_stage(self) -> int:
        return 0

    def gradient_accumulation_steps(self) -> int:
        return 1

    def shard_views(self) -> List[ShardView]:
        return self._views

    def refresh_after_load(self, weights_only: bool = False) -> None:
        self.refreshed.append(weights_only)

    def train_steps(self, n: int, seed: int) -> None:
        """Deterministic fake steps: the same global gradient on every world size."""
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for v in self._views:
                full = torch.randn(v.global_shape.numel(), generator=gen)
                if v.master is not None:
                    v.master.grad = full[v.start:v.end].clone()
            self.optimizer.inner.step()
            for v in self._views:
                if v.master is not None:
                    v.weight.copy_(v.master.to(v.weight.dtype))
            self.global_steps += 1


def write_synthetic(root: Path, tag: str, engines: List[FakeEngine], save_latest: bool = True,
                    exclude_frozen: bool = False) -> None:
    """What save_checkpoint does on ``len(engines)`` ranks, run rank by rank in one process."""
    staging = root / f".{tag}.partial"
    staging.mkdir(parents=True)
    for eng in engines:
        items, facts = engine_io._rank_items(eng, eng.shard_views(), exclude_frozen, {})
        engine_io._write_rank_files(eng, staging, items, facts, engine_io._rng_state(), None)
    meta = engine_io._global_meta(engines[0], tag, {"note": "hi"}, exclude_frozen)
    engine_io._commit(engines[0], root, staging, tag, meta, save_latest)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen = torch.nn.Linear(5, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("running", torch.arange(4, dtype=torch.float32))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def _trained(world: int, dtype: torch.dtype = torch.float32, steps: int = 3) -> List[FakeEngine]:
    engines = [FakeEngine(_net(), r, world, dtype) for r in range(world)]
    for e in engines:
        e.train_steps(steps, seed=7)
    return engines


# --------------------------------------------------------------------------- writer / reader


def test_safetensors_roundtrip_interop_and_checksums(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 4, generator=gen).bfloat16(), "b": torch.randn(7, generator=gen),
               "c": torch.tensor([True, False, True]), "d": torch.empty(0),
               "e": torch.arange(5, dtype=torch.int64)}
    calls = []
    items = [TensorItem(k, v.dtype, list(v.shape), (lambda v=v, k=k: calls.append(k) or v))
             for k, v in tensors.items()]
    record = write_safetensors(tmp_path / "x.safetensors", items, metadata={"format": "pt"})
    assert calls == list(tensors)  # producers called lazily, once each, in order
    assert record["size"] == os.path.getsize(tmp_path / "x.safetensors")
    raw = (tmp_path / "x.safetensors").read_bytes()
    begin = len(raw) - sum(v.numel() * v.element_size() for v in tensors.values())
    assert zlib.crc32(raw[:begin]) == record["header_crc32"]
    for k, v in tensors.items():  # the chunk crcs cover exactly each tensor's bytes
        lo, hi = record["tensors"][k]["offsets"]
        assert record["tensors"][k]["crc32"] == chunk_crcs(raw[begin + lo:begin + hi])
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:  # the real library reads it
        assert f.metadata() == {"format": "pt"}
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v)
    with SliceFileReader(tmp_path / "x.safetensors", record) as reader:
        for k, v in tensors.items():
            got = reader.read(k)
            assert got.dtype == v.dtype and torch.equal(got, v)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_truncated_and_corrupted_files_name_the_file(tmp_path, monkeypatch):
    from shardwise.checkpoint import format as fmt
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256)  # 4000 bytes -> 16 chunk crcs
    path = tmp_path / "y.safetensors"
    value = torch.randn(1000)
    record = write_safetensors(path, [TensorItem("t", torch.float32, [1000], value)])
    assert len(record["tensors"]["t"]["crc32"]) == 16
    with SliceFileReader(path, record) as reader:
        assert torch.equal(reader.read("t"), value)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="y.safetensors.*truncated"):
        SliceFileReader(path, record)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    path.write_bytes(bytes(flipped))
    reader = SliceFileReader(path, record)
    with pytest.raises(CheckpointError, match="y.safetensors.*checksum mismatch in tensor 't'"):
        reader.read("t")
    reader.close()
    flipped = bytearray(data)
    flipped[12] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="y.safetensors: header"):
        SliceFileReader(path, record)


def test_chunk_parallel_reads_verify_every_chunk(tmp_path, monkeypatch):
    """A tensor of many crc chunks is read by several threads at once, each into its slice of
    one buffer: the bytes must come back exactly, from any thread, and a flip in any one
    chunk (here the second) must still fail the whole read, naming the file and tensor."""
    from shardwise.checkpoint import format as fmt
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256)
    monkeypatch.setattr(fmt, "_read_workers", lambda: 4)
    path = tmp_path / "p.safetensors"
    gen = torch.Generator().manual_seed(1)
    tensors = {"big": torch.randn(999, generator=gen), "half": torch.randn(77, generator=gen).half(),
               "one": torch.randn(3, generator=gen)}
    record = write_safetensors(path, [TensorItem(k, v.dtype, list(v.shape), v) for k, v in tensors.items()])
    assert len(record["tensors"]["big"]["crc32"]) == 16  # 3996 bytes at 256 per chunk
    with SliceFileReader(path, record) as reader:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(3) as pool:  # concurrent reads through per-thread handles
            got = list(pool.map(reader.read, ["big", "half", "one"] * 4))
        for k, v in zip(["big", "half", "one"] * 4, got):
            assert torch.equal(v, tensors[k])
    data = bytearray(path.read_bytes())
    begin = len(data) - sum(v.numel() * v.element_size() for v in tensors.values())
    lo = record["tensors"]["big"]["offsets"][0]
    data[begin + lo + 256 + 17] ^= 0x10  # inside the second chunk of "big"
    path.write_bytes(bytes(data))
    with SliceFileReader(path, record) as reader:
        assert torch.equal(reader.read("half"), tensors["half"])  # other tensors unaffected
        with pytest.raises(CheckpointError, match="p.safetensors.*checksum mismatch in tensor 'big'"):
            reader.read("big")
    reader.close()  # closing twice is harmless
    with pytest.raises(ValueError, match="closed"):
        reader.read("one")


def test_file_shrunk_after_open_is_truncation_not_garbage(tmp_path, monkeypatch):
    """The size check at open cannot see a file cut later; the chunk reads must then report
    a short read as truncation instead of returning a partly filled buffer."""
    from shardwise.checkpoint import format as fmt
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256)
    path = tmp_path / "s.safetensors"
    value = torch.randn(1000)
    record = write_safetensors(path, [TensorItem("t", torch.float32, [1000], value)])
    reader = SliceFileReader(path, record)
    os.truncate(path, record["size"] - 600)
    with pytest.raises(CheckpointError, match="s.safetensors: tensor 't' is truncated"):
        reader.read("t")
    reader.close()


def test_read_ahead_keeps_order_bounds_memory_and_raises_at_the_bad_read(tmp_path, monkeypatch):
    from shardwise.checkpoint import reshard
    monkeypatch.setattr(reshard, "READ_AHEAD_READS", 2)
    src = _trained(2)
    write_synthetic(tmp_path, "t", src)
    with CheckpointReader(tmp_path) as reader:
        names = [n for n in reader.params if reader.has("master", n)]
        requests = [("master", n, 1, reader.numel(n) - 1) for n in names]
        requests += [("state.exp_avg", n, 0, reader.numel(n)) for n in names]
        want = [reader.read_range(*r) for r in requests]
        started = []
        plain = reader.read_range
        monkeypatch.setattr(reader, "read_range", lambda *a: started.append(a) or plain(*a))
        with contextlib.closing(reader.read_ranges(requests, workers=3)) as got:
            for consumed, w in enumerate(want, start=1):
                assert torch.equal(next(got), w)
                # never more than READ_AHEAD_READS reads beyond the one just handed out
                assert len(started) <= consumed + 2
            assert next(got, None) is None
        assert sorted(started) == sorted(requests)  # each read once (threads may start them out of order)
    # a corrupted file: the reads before the bad one arrive, the bad one raises CheckpointError
    path = tmp_path / "t" / "rank00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with CheckpointReader(tmp_path) as reader:
        order = [(k, n, 0, reader.numel(n)) for n in reader.params for k in reader.kinds(n)]
        good = []
        with pytest.raises(CheckpointError, match="rank00001-of-00002.safetensors.*checksum"):
            with contextlib.closing(reader.read_ranges(order, workers=2)) as got:
                for _ in order:
                    good.append(next(got))
        assert len(good) < len(order)
    with pytest.raises(CheckpointError, match="rank00001-of-00002.safetensors"):
        load_checkpoint(FakeEngine(_net(), 0, 1), tmp_path)


def _pipeline_items():
    """Tensors that exercise every branch of the writer at CHUNK_BYTES=256: pieces that share a
    buffer, one that does not fit the rest of a buffer, tensors spanning several chunks, bool,
    non-contiguous, empty, and a CPU tensor between staged ones."""
    gen = torch.Generator().manual_seed(3)
    return {"small": torch.randn(5, generator=gen).half(),           # 10 bytes
            "mid": torch.randn(40, generator=gen),                   # 160 bytes: shares a buffer
            "big": torch.randn(300, generator=gen),                  # 1200 bytes: 5 chunks
            "mask": torch.rand(50, generator=gen) > 0.5,             # bool
            "strided": torch.randn(6, 20, generator=gen).t(),        # non-contiguous
            "empty": torch.empty(0, dtype=torch.bfloat16),
            "tail": torch.randn(64, generator=gen).bfloat16()}       # exactly 128 bytes


def test_ring_pipeline_writes_the_same_bytes_and_crcs(tmp_path, monkeypatch):
    """The device path (host ring, packed small tensors, slot reuse) must produce the file
    and record of the direct path byte for byte; CPU tensors forced through it stand in for
    device tensors here (tests/gpu runs the real CUDA path)."""
    from shardwise.checkpoint import format as fmt
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256)
    monkeypatch.setattr(fmt, "_INLINE_CRC_BYTES", 64)  # pieces >= 64 B go through the pool
    tensors = _pipeline_items()
    items = [TensorItem(k, v.dtype, list(v.shape), v) for k, v in tensors.items()]
    direct = write_safetensors(tmp_path / "direct.safetensors", items)
    allocated = []
    real_alloc = fmt._HostRing._alloc
    monkeypatch.setattr(fmt._HostRing, "_alloc",
                        staticmethod(lambda n: allocated.append(1) or real_alloc(n)))
    ring = write_safetensors(tmp_path / "ring.safetensors", items, _stage_host=True)
    assert (tmp_path / "ring.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()
    assert ring == direct
    assert len(direct["tensors"]["big"]["crc32"]) == 5 and direct["tensors"]["empty"]["crc32"] == []
    # 14 chunks of data cycle through the ring's few buffers, allocated once for the file
    assert len(allocated) == fmt._ring_slots() < 14
    with SliceFileReader(tmp_path / "ring.safetensors", ring) as reader:
        for k, v in tensors.items():
            assert torch.equal(reader.read(k), v.contiguous())
    with safe_open(str(tmp_path / "ring.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("strided"), tensors["strided"])


def test_host_tensors_are_written_from_their_own_memory(tmp_path, monkeypatch):
    """A CPU tensor goes to ``write`` as a view of its storage (no host ring, no copy)."""
    from shardwise.checkpoint import format as fmt
    value = torch.arange(1000, dtype=torch.float32)
    monkeypatch.setattr(fmt._HostRing, "_alloc",
                        staticmethod(lambda n: pytest.fail("a CPU-only save allocated ring buffers")))
    seen = []
    real_open = fmt.atomic_open

    class Spy:
        def __init__(self, f):
            self.f = f

        def write(self, buf):
            if not isinstance(buf, bytes):
                seen.append(buf.__array_interface__["data"][0])
            return self.f.write(buf)

        def fileno(self):
            return self.f.fileno()

    from contextlib import contextmanager

    @contextmanager
    def spy_open(path, fsync=True):
        with real_open(path, fsync=fsync) as f:
            yield Spy(f)

    monkeypatch.setattr(fmt, "atomic_open", spy_open)
    write_safetensors(tmp_path / "h.safetensors", [TensorItem("v", torch.float32, [1000], value)])
    assert seen == [value.data_ptr()]


def test_writeback_is_started_window_by_window(tmp_path, monkeypatch):
    """Every WRITEBACK_BYTES of data the writer asks the OS to start writing back, over
    consecutive ranges; a refusal turns it off for the file and the save still succeeds."""
    from shardwise.checkpoint import format as fmt
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 256)
    monkeypatch.setattr(fmt, "WRITEBACK_BYTES", 1000)
    calls = []
    monkeypatch.setattr(fmt, "_sync_file_range", lambda: lambda fd, off, n, flags: calls.append(
        (off, n, flags)) or 0)
    value = torch.randn(2000)  # 8000 bytes
    record = write_safetensors(tmp_path / "w.safetensors", [TensorItem("v", torch.float32, [2000], value)])
    assert calls and all(flags == fmt._SYNC_FILE_RANGE_WRITE and n >= 1000 for _, n, flags in calls)
    assert [off for off, _, _ in calls] == [0] + [off + n for off, n, _ in calls[:-1]]
    assert calls[-1][0] + calls[-1][1] > record["size"] - 1000  # up to the last full window
    calls.clear()
    write_safetensors(tmp_path / "nofsync.safetensors",
                      [TensorItem("v", torch.float32, [2000], value)], fsync=False)
    assert calls == []  # nothing to be durable for: leave the page cache alone
    refused = []
    monkeypatch.setattr(fmt, "_sync_file_range", lambda: lambda *a: refused.append(a) or -1)
    record = write_safetensors(tmp_path / "r.safetensors", [TensorItem("v", torch.float32, [2000], value)])
    assert len(refused) == 1
    with SliceFileReader(tmp_path / "r.safetensors", record) as reader:
        assert torch.equal(reader.read("v"), value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_real_sync_file_range_resolves_on_linux(tmp_path, monkeypatch):
    from shardwise.checkpoint import format as fmt
    fn = fmt._sync_file_range()
    assert fn is not None
    monkeypatch.setattr(fmt, "WRITEBACK_BYTES", 4096)
    value = torch.randn(100_000)
    record = write_safetensors(tmp_path / "l.safetensors", [TensorItem("v", torch.float32, [100_000], value)])
    with SliceFileReader(tmp_path / "l.safetensors", record) as reader:
        assert torch.equal(reader.read("v"), value)


def test_async_stage_items_snapshots_values(monkeypatch):
    from shardwise.checkpoint import async_save
    src = torch.arange(10, dtype=torch.float32)
    lazy = torch.ones(3, dtype=torch.bfloat16)
    items = [TensorItem("a", src.dtype, [10], src, {"kind": "x"}),
             TensorItem("b", lazy.dtype, [3], lambda: lazy)]
    staged = async_save.stage_items(items)
    src.add_(100)  # training goes on after the snapshot
    assert torch.equal(staged[0].source, torch.arange(10, dtype=torch.float32))
    assert staged[0].info == {"kind": "x"} and staged[0].source.data_ptr() != src.data_ptr()
    assert torch.equal(staged[1].source, lazy) and not callable(staged[1].source)


def test_tags_are_validated():
    for good in ("global_step10", "best-v2", "epoch.3"):
        assert validate_tag(good) == good
    for bad in ("a/b", "a\\b", "c:d", "", ".hidden", "x.", "CON", "nul.txt", "a*b"):
        with pytest.raises(CheckpointError):
            validate_tag(bad)


def test_atomic_write_replaces_or_leaves_old(tmp_path):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")
    atomic_write_bytes(target, b"new")  # onto an existing file (what os.rename cannot on Windows)
    assert target.read_bytes() == b"new"
    with pytest.raises(RuntimeError):
        with atomic_open(target) as f:
            f.write(b"half")
            raise RuntimeError("killed")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    with pytest.raises(CheckpointError, match="':'"):
        atomic_write_bytes(tmp_path / "a:b", b"x")


def test_json_encoding_roundtrip_and_refusal():
    value = {"lr": 0.1, "betas": (0.9, 0.999), "step": torch.tensor(5.0), 3: [1, None, "s"],
             "raw": b"\x00\x01", "t": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    back = from_jsonable(json.loads(json.dumps(to_jsonable(value, "x"))))
    assert back["betas"] == (0.9, 0.999) and back[3] == [1, None, "s"] and back["raw"] == b"\x00\x01"
    assert torch.equal(back["t"], value["t"]) and back["step"].dtype == torch.float32
    with pytest.raises(CheckpointError, match="never pickle"):
        to_jsonable({"f": object()}, "client_state")


# --------------------------------------------------------------------------- resharding


def test_reshard_3_to_2_restores_slices_and_adam_state(tmp_path):
    src = _trained(3, torch.bfloat16)
    write_synthetic(tmp_path, "global_step3", src)
    full_master = {v.name: torch.cat([e.shard_views()[i].master for e in src])
                   for i, v in enumerate(src[0].shard_views()) if v.master is not None}
    full_avg = {n: torch.cat([e.optimizer.inner.state[e.shard_views()[i].master]["exp_avg"]
                              for e in src])
                for i, n in enumerate(v.name for v in src[0].shard_views()) if n in full_master}
    with CheckpointReader(tmp_path) as reader:
        assert reader.tag == "global_step3" and reader.world_size == 3
        n = reader.numel("fc.weight")
        for lo, hi in ((0, n), (1, n - 1), (9, 11), (n - 1, n), (4, 4)):
            assert torch.equal(reader.read_range("master", "fc.weight", lo, hi),
                               full_master["fc.weight"][lo:hi])
    dst = [FakeEngine(_net(seed=5), r, 2, torch.bfloat16) for r in range(2)]
    for eng in dst:
        path, client = load_checkpoint(eng, tmp_path)
        assert client == {"note": "hi"} and path.endswith("global_step3")
        assert eng.refreshed == [False]
        for v in eng.shard_views():
            if v.master is None:
                continue
            assert torch.equal(v.master, full_master[v.name][v.start:v.end])
            assert torch.equal(v.weight, full_master[v.name][v.start:v.end].bfloat16())
            state = eng.optimizer.inner.state[v.master]
            assert torch.equal(state["exp_avg"], full_avg[v.name][v.start:v.end])
            assert state["step"].item() == 3.0 and state["step"].dtype == torch.float32
    # buffers and frozen weights came back too
    assert torch.equal(dst[0].module.running, torch.arange(4, dtype=torch.float32))
    assert torch.equal(dst[0].module.frozen.weight[:1], src[0].module.frozen.weight[:1])
    # continuing on 2 ranks gives the same masters as continuing on 3
    for e in src + dst:
        e.train_steps(2, seed=11)
    for v in dst[1].shard_views():
        if v.master is not None:
            ref = torch.cat([e.shard_views()[[x.name for x in e.shard_views()].index(v.name)].master
                             for e in src])
            assert torch.equal(v.master, ref[v.start:v.end])


def test_wrong_model_and_truncated_checkpoint_raise(tmp_path):
    write_synthetic(tmp_path, "t1", _trained(2))

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(6, 4)

    with pytest.raises(CheckpointError, match="does not match the model"):
        load_checkpoint(FakeEngine(Other(), 0, 1), tmp_path)
    with pytest.raises(CheckpointError, match="'fc.weight' has shape"):
        load_checkpoint(FakeEngine(Other(), 0, 1), tmp_path, load_module_strict=False)
    data = tmp_path / "t1" / "rank00001-of-00002.safetensors"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="rank00001-of-00002.safetensors"):
        load_checkpoint(FakeEngine(_net(), 0, 1), tmp_path)
    (tmp_path / "t1" / META_FILE).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(FakeEngine(_net(), 0, 1), tmp_path)


def test_load_module_only_and_missing_latest(tmp_path):
    assert load_checkpoint(FakeEngine(_net(), 0, 1), tmp_path / "none") == (None, None)
    src = _trained(1)
    write_synthetic(tmp_path, "t", src)
    eng = FakeEngine(_net(seed=3), 0, 1)
    before = [v.master.clone() for v in eng.shard_views() if v.master is not None]
    load_checkpoint(eng, tmp_path, load_module_only=True)
    assert eng.refreshed == [True] and not eng.optimizer.inner.state
    assert all(torch.equal(a, v.master) for a, v in
               zip(before, [v for v in eng.shard_views() if v.master is not None]))
    assert torch.equal(eng.module.fc.weight, src[0].module.fc.weight)


def test_get_fp32_state_dict_any_world_size(tmp_path):
    src = _trained(4, torch.bfloat16)
    write_synthetic(tmp_path, "t", src)
    state = get_fp32_state_dict(tmp_path)
    ref = {n: torch.cat([e.shard_views()[i].master for e in src]).reshape(v.global_shape)
           for i, (n, v) in enumerate((v.name, v) for v in src[0].shard_views()) if v.master is not None}
    for name, value in ref.items():
        assert value.dtype == torch.float32 and torch.equal(state[name], value)
    assert state["head.weight"] is state["emb.weight"]  # tied names both present
    assert torch.equal(state["frozen.weight"], src[0].module.frozen.weight.float())
    assert "running" in state and "scratch" not in state
    fresh = _net(seed=9)
    fresh.load_state_dict(state)  # strict: every key of the module present


def test_same_tag_resave_replaces_and_frozen_exclusion(tmp_path):
    first = _trained(2, steps=1)
    write_synthetic(tmp_path, "t", first)
    second = _trained(2, steps=3)
    write_synthetic(tmp_path, "t", second, save_latest=False, exclude_frozen=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]  # no leftovers
    with CheckpointReader(tmp_path, "t") as reader:
        assert "frozen.weight" not in reader.params
        assert torch.equal(reader.read_full("master", "fc.bias"),
                           torch.cat([e.shard_views()[2].master for e in second]))
    eng = FakeEngine(_net(seed=4), 0, 1)
    frozen_before = eng.module.frozen.weight.clone()
    load_checkpoint(eng, tmp_path)  # strict, yet the excluded frozen weights may be missing
    assert torch.equal(eng.module.frozen.weight, frozen_before)
    assert eng.optimizer.inner.state[eng.shard_views()[0].master]["step"].item() == 3.0


def test_the_engine_implements_the_checkpoint_contract_explicitly() -> None:
    """The checkpoint code calls the engine through ``CheckpointableEngine`` without probing
    it; the engine subclasses the Protocol, so a member it drops fails here (and at import
    for a type checker), not in the middle of a save."""
    import shardwise
    from shardwise.checkpoint.contract import CheckpointableEngine
    from shardwise.runtime.engine import ShardwiseEngine
    assert CheckpointableEngine in ShardwiseEngine.__mro__
    engine, *_ = shardwise.initialize(model=_net(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
        "checkpoint": {"tag_validation": "Fail", "async_save": True}})
    assert isinstance(engine, CheckpointableEngine)
    settings = engine.checkpoint_settings()
    assert (settings.tag_validation, settings.async_save) == ("FAIL", True)
    assert settings.config["train_micro_batch_size_per_gpu"] == 2
    assert engine.pending_save is None
    # no optimizer, no strategy: every parameter whole, owned by rank 0
    views = engine.shard_views()
    assert [v.name for v in views] == [n for n, _ in engine.module.named_parameters()]
    assert all(v.numel == v.param.numel() and v.master is None for v in views)
    engine.destroy()
