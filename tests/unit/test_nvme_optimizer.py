"""Optimizer states on NVMe (``offload_optimizer: {device: "nvme"}``) in one process: the
streamed step against plain torch, its pipeline order, where the states live, the swap
files' lifetime, the errors for bad paths, and checkpoints to and from CPU offload."""
from __future__ import annotations

import gc
import shutil
from pathlib import Path
from typing import List

import psutil
import pytest
import torch

import shardwise
from shardwise.errors import ConfigError, StorageError
from shardwise.io import swap_dir
from shardwise.offload.nvme_states import NvmeOptimizerStates, SubGroup, split_sub_groups
from tests.distributed._parity import (engine_config, global_batches, make_model, max_rel_diff,
                                       reference_params, train_engine)

LR = 1e-2


def _nvme(path, **opts) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "pin_memory": True, **opts}


def _zero(stage: int, path, **opts) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 200, "offload_optimizer": _nvme(path, **opts)}
    if stage == 3:  # weights partitioned (on NVMe), biases persistent (on the device)
        zero["stage3_param_persistence_threshold"] = 30
    return zero


def _swap_files(root) -> List[Path]:
    return sorted(Path(root).glob("shardwise_swap/*/group*.swp"))


# --- the streamed step itself ------------------------------------------------------------------
def _masters(sizes, seed=0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_streamed_step_equals_adamw_and_keeps_no_state_in_memory(tmp_path, buffers) -> None:
    sizes = [300, 17, 1000, 64, 5]
    ref = [m.clone() for m in _masters(sizes)]
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.01)
    keys = [m.clone() for m in _masters(sizes)]
    groups = split_sub_groups(keys, 400)
    assert [len(g.keys) for g in groups] == [2, 1, 2]
    initial = [torch.cat([k.reshape(-1) for k in g.keys]) for g in groups]
    states = NvmeOptimizerStates(groups, lambda i: initial[i], nvme_path=str(tmp_path), rank=3,
                                 aio_kwargs={}, buffer_count=buffers)
    inner = torch.optim.AdamW(keys, lr=LR, weight_decay=0.01)
    states.bind(inner)
    assert states.names == ("exp_avg", "exp_avg_sq")
    files = _swap_files(tmp_path)
    assert len(files) == 3 and all("rank00003" in str(f) for f in files)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(n, generator=g) for n in sizes]
        for r, grad in zip(ref, grads):
            r.grad = grad.clone()
        ref_opt.step()
        by_key = {id(k): grad for k, grad in zip(keys, grads)}
        log = []

        def step(i):
            log.append(("step", i))
            for k in groups[i].keys:
                k.grad = by_key[id(k)]
            inner.step()
            for k in groups[i].keys:
                k.grad = None

        def to_device(i):
            log.append(("copy", i))
            return lambda: log.append(("copied", i))

        states.step_groups(step, to_device)
        # a ring buffer is read into again only after the copy that read it finished:
        # with 3+ buffers the copy of i-1 is waited for while i is stepped, with 2 at once
        lag = 1 if buffers >= 3 else 0
        expected = []
        for i in range(3):
            expected += [("step", i), ("copy", i)] + ([("copied", i - lag)] if i >= lag else [])
        assert log == expected + [("copied", i) for i in range(3 - lag, 3)]
        # nothing of the optimizer's per-element state stays in host memory
        assert all(k.stride() == (0,) for k in keys)
        assert all(set(inner.state[k]) == {"step"} for k in keys)
    states.materialize()
    for k, r in zip(keys, ref):
        assert torch.allclose(k, r, rtol=1e-6, atol=1e-7)
        assert torch.allclose(inner.state[k]["exp_avg"], ref_opt.state[r]["exp_avg"])
        assert torch.allclose(inner.state[k]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
    states.dematerialize(write=False)
    states.close()
    assert not list(Path(tmp_path).glob("shardwise_swap/*"))


def test_sub_groups_pack_keys_up_to_the_size() -> None:
    keys = [torch.zeros(n) for n in (10, 10, 30, 5)]
    groups = split_sub_groups(keys, 20)
    assert [g.numel for g in groups] == [20, 30, 5]
    assert groups[0].offsets == (0, 10)
    assert SubGroup.packed(keys[:1]).spans()[0][1:] == (0, 10)


# --- engines: parity, swap files, errors -------------------------------------------------------
@pytest.mark.parametrize("stage,ga,clip", [(1, 1, 0.0), (2, 2, 0.05), (3, 2, 0.05), (3, 1, 0.0)])
def test_nvme_offload_matches_torch_reference(tmp_path, stage, ga, clip) -> None:
    cfg = engine_config(stage, 2, ga, clip, LR, zero_optimization=_zero(stage, tmp_path))
    got = train_engine(0, 1, cfg, steps=6)
    assert not max_rel_diff(got, reference_params(6, 2 * ga, LR, clip))


@pytest.mark.parametrize("stage", [2, 3])
def test_swap_files_live_during_training_and_go_with_destroy(tmp_path, stage) -> None:
    engine, *_ = shardwise.initialize(model=make_model(), config=engine_config(
        stage, 2, 1, 0.0, LR, zero_optimization=_zero(stage, tmp_path, buffer_count=3)))
    files = _swap_files(tmp_path)
    assert files, "no swap files after initialize"
    assert engine.zero_nvme_offload_optimizer()
    assert engine.swap_tensor_config()["nvme_path"] == str(tmp_path)
    sizes = [f.stat().st_size for f in files]
    for x, y in global_batches(2, 2):
        engine.backward(engine(x, y))
        engine.step()
    assert _swap_files(tmp_path) == files and [f.stat().st_size for f in files] == sizes
    # the CPU optimizer's per-element state is in the files, not in host memory
    inner = engine.optimizer.inner
    nvme = engine.strategy.nvme if stage == 3 else engine.strategy.pipeline.nvme
    keys = [k for g in nvme.groups for k in g.keys]
    assert keys and all(set(inner.state[k]) == {"step"} and k.stride() == (0,) for k in keys)
    engine.destroy()
    assert not (tmp_path / "shardwise_swap").exists()


def _init(path_value, stage=2, **opts):
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": path_value, **opts}}
    return shardwise.initialize(model=make_model(), config=engine_config(
        stage, 2, 1, 0.0, LR, zero_optimization=zero))


def test_bad_nvme_paths_fail_at_initialize_naming_the_path(tmp_path, monkeypatch) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StorageError, match=r"offload_optimizer.nvme_path = '.*afile'.*regular file"):
        _init(str(afile))
    with pytest.raises(StorageError, match=r"afile/sub'.*cannot be created"):
        _init(str(afile / "sub"), stage=3)
    with pytest.raises(ConfigError, match=r"offload_optimizer.*nvme_path is not set"):
        _init(None)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(swap_dir.shutil, "disk_usage",
                        lambda p: usage._replace(free=1024))
    with pytest.raises(StorageError, match=r"'.*small'.*too full: the swap files need"):
        _init(str(tmp_path / "small"))
    monkeypatch.undo()
    real_open = swap_dir.os.open

    def read_only(path, flags, *a):
        if str(path).endswith(".probe"):
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, *a)
    monkeypatch.setattr(swap_dir.os, "open", read_only)
    with pytest.raises(StorageError, match=r"'.*ro'.*is read-only"):
        _init(str(tmp_path / "ro"))


def test_nvme_refuses_what_it_cannot_do(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"delayed_update needs device \"cpu\""):
        _init(str(tmp_path), delayed_update=True)
    with pytest.raises(ConfigError, match=r"ratio 0.5 needs device \"cpu\""):
        _init(str(tmp_path), ratio=0.5)
    with pytest.raises(ConfigError, match=r"buffer_count = 1"):
        _init(str(tmp_path), buffer_count=1)


# --- checkpoints -------------------------------------------------------------------------------
def _train(engine, batches) -> None:
    for x, y in batches:
        engine.backward(engine(x, y))
        engine.step()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("save_with,load_with", [("nvme", "cpu"), ("cpu", "nvme"),
                                                 ("nvme", "none"), ("nvme", "nvme")])
def test_checkpoints_move_between_nvme_cpu_and_no_offload(tmp_path, stage, save_with,
                                                          load_with) -> None:
    def config(device):
        zero = _zero(stage, tmp_path / "swap")
        if device == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        elif device == "none":
            zero.pop("offload_optimizer")
        return engine_config(stage, 2, 1, 0.0, LR, zero_optimization=zero)

    batches = global_batches(6, 2)
    first, *_ = shardwise.initialize(model=make_model(), config=config(save_with))
    _train(first, batches[:3])
    first.save_checkpoint(str(tmp_path / "ckpt"), tag="t3")
    _train(first, batches[3:4])  # the save left the run as it was
    first.destroy()
    second, *_ = shardwise.initialize(model=make_model(seed=5), config=config(load_with))
    second.load_checkpoint(str(tmp_path / "ckpt"), tag="t3")
    _train(second, batches[3:])
    views = {v.name: v for v in second.shard_views()}
    for name, want in reference_params(6, 2, LR, 0.0).items():
        got = views[name].master.view(want.shape).float()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (name, save_with, load_with)
    second.destroy()
    assert not (tmp_path / "swap" / "shardwise_swap").exists()


# --- host memory -------------------------------------------------------------------------------
def test_host_memory_stays_flat_over_300_steps(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000, "sub_group_size": 60_000,
                              "stage3_param_persistence_threshold": 1000,
                              "offload_optimizer": _nvme(tmp_path)}})
    assert len(engine.strategy.nvme.groups) >= 2
    x = torch.randn(8, 256)
    proc = psutil.Process()
    rss = []
    for step in range(300):
        engine.backward(engine(x).square().mean())
        engine.step()
        if step in (50, 299):
            gc.collect()
            rss.append(proc.memory_info().rss)
    assert rss[1] - rss[0] < 8 * 2**20, f"RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"
    engine.destroy()
