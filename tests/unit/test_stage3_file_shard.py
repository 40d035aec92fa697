"""``FileShard`` / ``ParamSwapper`` (offload_param on NVMe) on their own: values survive the
pool's read-ahead, buffer reuse, writes, partial writes, in-place edits of held copies and
swaps; the folder goes with close(). And an engine on a plain torch model: training with
the partitions in swap files gives exactly the parameters of ``offload_param`` on the CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.io.swap_files import SwapFiles
from shardwise.zero.stage3.file_shard import FileShard, ParamSwapper

pytestmark = pytest.mark.windows  # file IO: per-thread handles and no O_DIRECT there


def _swapper(tmp_path: Path, buffers: int = 2, elems: int = 10_000) -> ParamSwapper:
    files = SwapFiles(str(tmp_path), 0, key="offload_param.nvme_path")
    return ParamSwapper(files, buffer_count=buffers, buffer_elems=elems, cpu_budget=0,
                        min_bytes=0)


def _shards(sw: ParamSwapper, n: int, numel: int = 1500):
    values = [torch.randn(numel) for _ in range(n)]
    shards = [sw.place(v[:numel - 3], numel, torch.float32, torch.Size([numel])) for v in values]
    for v in values:
        v[numel - 3:] = 0  # the padding past the values given is zero
    return shards, values


def _read(shard: FileShard) -> torch.Tensor:
    out = shard.staged().clone()
    shard.unstage()
    return out


def test_values_through_read_ahead_and_buffer_reuse(tmp_path: Path) -> None:
    sw = _swapper(tmp_path)
    shards, values = _shards(sw, 4)
    assert all(isinstance(s, FileShard) for s in shards)
    sw.flush()  # the initial writes are done: their buffers are free
    assert shards[0].prefetch()  # one buffer of two: the other stays for demand reads
    assert not shards[1].prefetch()
    for shard, want in zip(shards[::-1], values[::-1]):  # demand reads take the buffer back
        assert torch.equal(_read(shard), want)
    assert torch.equal(_read(shards[0]), values[0])
    assert sw.stats["read_ahead"] == 1 and sw.stats["demand_reads"] >= 4
    sw.close()


def test_writes_partial_writes_and_held_copies(tmp_path: Path) -> None:
    sw = _swapper(tmp_path, buffers=3)
    shards, values = _shards(sw, 3)
    new = torch.randn(1500)
    shards[0].write_(new)
    assert torch.equal(_read(shards[0]), new)  # the read waits for the write
    shards[1].write_(torch.ones(4), offset=10)  # read, modify, write
    values[1][10:14] = 1
    assert torch.equal(_read(shards[1]), values[1])
    dst = torch.empty(7)
    shards[1].copy_to(dst)
    assert torch.equal(dst, values[1][:7])
    held = shards[2].tensor()  # a copy: edits reach the file at commit
    held[:5].copy_(torch.full((5,), 3.0))
    values[2][:5] = 3.0
    assert torch.equal(shards[2].tensor(), values[2])  # the same held copy
    sw.commit_held()
    assert shards[2]._held is None and torch.equal(_read(shards[2]), values[2])
    clean = shards[0].tensor()  # unedited: dropped at the next gather, no write
    writes = sw.stats["writes"]
    assert torch.equal(_read(shards[0]), clean) and shards[0]._held is None
    sw.commit_held()
    assert sw.stats["writes"] == writes
    shards[0].swap(shards[2])
    assert torch.equal(_read(shards[0]), values[2]) and torch.equal(_read(shards[2]), new)
    folder = Path(sw.path)
    assert len(list(folder.glob("*.swp"))) == 3
    sw.close()
    assert not folder.exists()


def test_placement_rules(tmp_path: Path) -> None:
    files = SwapFiles(str(tmp_path), 0, key="offload_param.nvme_path")
    sw = ParamSwapper(files, buffer_count=2, buffer_elems=1000, cpu_budget=600, min_bytes=1024)
    t = torch.zeros(900)
    assert sw.place(t[:200], 200, torch.float32, torch.Size([200])) is None  # 800 B < 1 KiB
    assert sw.place(t[:500], 500, torch.float32, torch.Size([500])) is None  # max_in_cpu
    assert isinstance(sw.place(t[:300], 300, torch.float32, torch.Size([300])), FileShard)
    from shardwise.errors import ConfigError
    with pytest.raises(ConfigError, match="buffer_size = 1000 elements.*at least 1200"):
        sw.place(torch.zeros(1200), 1200, torch.float32, torch.Size([1200]))
    assert (sw.on_nvme, sw.in_cpu) == (1, 1)
    sw.close()


def _train_plain(offload_param: dict):
    import shardwise
    from shardwise.zero import GatheredParameters
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 100,
                                 "offload_optimizer": {"device": "cpu"},
                                 "offload_param": offload_param}}
    engine = shardwise.initialize(model=model, config=cfg)[0]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 32, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        out = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    engine.destroy()
    return out


def test_engine_with_nvme_partitions_equals_cpu_offload(tmp_path: Path) -> None:
    want = _train_plain({"device": "cpu"})
    got = _train_plain({"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0,
                        "min_nvme_bytes": 0, "buffer_count": 2})
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not list(tmp_path.rglob("*.swp"))


def test_host_memory_stays_flat_over_300_steps(tmp_path: Path) -> None:
    """300 rounds of read-ahead, staged copies and write-backs of 4 partitions: the values
    follow every write and resident memory does not grow (no leak of buffers, requests or
    held copies)."""
    import psutil
    sw = _swapper(tmp_path, buffers=3, elems=20000)
    shards, _ = _shards(sw, 4, numel=20000)
    for s in shards:
        s.write_(torch.zeros(20000))
    proc, rss = psutil.Process(), []
    for step in range(300):
        for s in shards:
            s.prefetch()
        for s in shards:
            s.write_(_read(s) + 1)
        if step in (49, 299):
            rss.append(proc.memory_info().rss)
    assert all(torch.equal(_read(s), torch.full((20000,), 300.0)) for s in shards)
    assert rss[1] - rss[0] < 8 * 2**20
    sw.close()
