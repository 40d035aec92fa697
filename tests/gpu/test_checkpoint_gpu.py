"""Checkpoints of CUDA tensors through the pinned device-to-host pipeline: the writer's bytes
and crcs equal those of the same tensors on the host, and an engine round trip (ZeRO-2 bf16,
plain and async) is bit-exact for weights, fp32 masters and Adam states."""
from __future__ import annotations

import pytest
import torch

import shardwise.accelerator
from shardwise.checkpoint import format as fmt
from shardwise.checkpoint.engine_state import _inner_optimizer
from shardwise.checkpoint.format import SliceFileReader, TensorItem, write_safetensors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _device_tensors():
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(20 * 1024 * 1024 + 3, device="cuda", generator=gen)  # 80 MiB: 3 chunks
    return {"small": torch.randn(7, device="cuda", generator=gen).bfloat16(),
            "big": big,
            "mask": torch.rand(33, device="cuda", generator=gen) > 0.5,
            "strided": torch.randn(64, 48, device="cuda", generator=gen).t(),
            "empty": torch.empty(0, device="cuda", dtype=torch.float16),
            "ids": torch.arange(1000, device="cuda"),
            "host": torch.randn(100),  # a CPU tensor between device ones (offloaded state)
            "last": torch.randn(5000, device="cuda", generator=gen).half()}


def test_device_tensors_write_the_bytes_of_their_host_copies(tmp_path, monkeypatch):
    tensors = _device_tensors()
    pinned = []
    real_alloc = fmt._HostRing._alloc
    monkeypatch.setattr(fmt._HostRing, "_alloc",
                        staticmethod(lambda n: (lambda t: pinned.append(t.is_pinned()) or t)(real_alloc(n))))
    lazy = {k: (lambda v=v: v.clone()) for k, v in tensors.items()}  # temporaries, freed after use
    dev_items = [TensorItem(k, v.dtype, list(v.shape), lazy[k]) for k, v in tensors.items()]
    dev = write_safetensors(tmp_path / "dev.safetensors", dev_items)
    # (failed once in a full tests/gpu run and passed alone: say which part, next time)
    assert pinned and all(pinned) and len(pinned) <= fmt._ring_slots(), \
        f"ring buffers pinned: {pinned}, ring slots {fmt._ring_slots()}, " \
        f"accelerator {shardwise.accelerator.get_accelerator()!r}"
    host = {k: v.cpu() for k, v in tensors.items()}
    host_items = [TensorItem(k, v.dtype, list(v.shape), v) for k, v in host.items()]
    ref = write_safetensors(tmp_path / "host.safetensors", host_items)
    assert (tmp_path / "dev.safetensors").read_bytes() == (tmp_path / "host.safetensors").read_bytes()
    assert dev == ref
    with SliceFileReader(tmp_path / "dev.safetensors", dev) as reader:
        for k, v in host.items():
            assert torch.equal(reader.read(k), v.contiguous()), k


def _engine(async_save: bool, seed: int):
    import shardwise
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64),
                                torch.nn.LayerNorm(64))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
           "checkpoint": {"async_save": async_save}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    assert engine.device.type == "cuda"
    return engine


def _step(engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 256, generator=gen).to(engine.device, torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()


def _snapshot(engine):
    inner = _inner_optimizer(engine)
    out = {}
    for v in engine.shard_views():
        out[f"weight/{v.name}"] = v.weight.detach().cpu().clone()
        if v.master is not None:
            out[f"master/{v.name}"] = v.master.detach().cpu().clone()
            for key, value in inner.state.get(v.master, {}).items():
                if torch.is_tensor(value):
                    out[f"{key}/{v.name}"] = value.detach().cpu().clone()
    return out


def _assert_bit_exact(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8),
                                                         b[k].view(-1).view(torch.uint8)), k


@pytest.mark.parametrize("async_save", [False, True])
def test_engine_round_trip_on_cuda_is_bit_exact(tmp_path, monkeypatch, async_save):
    from shardwise.checkpoint.async_save import wait_pending
    monkeypatch.setattr(fmt, "CHUNK_BYTES", 64 * 1024)  # several chunks and packed buffers
    monkeypatch.setattr(fmt, "_INLINE_CRC_BYTES", 1024)
    engine = _engine(async_save, seed=0)
    for s in range(3):
        _step(engine, s)
    saved = _snapshot(engine)
    engine.save_checkpoint(tmp_path, tag="t")
    if async_save:
        _step(engine, 99)  # training goes on while the background thread writes
        wait_pending(engine)
    fresh = _engine(async_save, seed=1)
    assert not torch.equal(_snapshot(fresh)["master/0.weight"], saved["master/0.weight"])
    path, _ = fresh.load_checkpoint(tmp_path)
    assert path is not None
    _assert_bit_exact(_snapshot(fresh), saved)
    if not async_save:  # both continue identically
        _step(engine, 5)
        _step(fresh, 5)
        _assert_bit_exact(_snapshot(fresh), _snapshot(engine))
