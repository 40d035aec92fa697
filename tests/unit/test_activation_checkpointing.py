"""shardwise.checkpointing: the DeepSpeed-named API, RNG replay and each config key's effect."""
from __future__ import annotations

import gc
import json
import logging
import types
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from shardwise.activation import recompute as ckmod
from shardwise.activation.cpu_offload import HostCopy
from shardwise.errors import ConfigError
from tests.dist_utils import run_distributed

ck = shardwise.checkpointing
H = 16


class Block(nn.Module):
    """Norm -> MLP with dropout; a second dropout under the model-parallel RNG stream."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(F.gelu(self.up(self.norm(x))))
        with ck.get_cuda_rng_tracker().fork():
            y = F.dropout(y, 0.2, training=self.training)
        return x + self.down(y)


class Stack(nn.Module):
    def __init__(self, n: int = 3, mode: str = "plain") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "plain":
                x = block(x)
            elif self.mode == "checkpoint":
                x = ck.checkpoint(block, x)
            else:
                x = ck.non_reentrant_checkpoint(block, x)
        return x


@pytest.fixture(autouse=True)
def _fresh_state():
    ck.configure()  # every key back to its default
    yield
    ck.configure()


def _grads(mode: str, seed: int = 7, n: int = 3, x_requires_grad: bool = True):
    torch.manual_seed(0)
    model = Stack(n, mode)
    x = torch.randn(4, 5, H, requires_grad=x_requires_grad)
    ck.model_parallel_cuda_manual_seed(seed)
    out = model(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return grads + ([x.grad.clone()] if x_requires_grad else [])


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _capture_logs():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardwise").addHandler(handler)
    return records, handler


def test_checkpointed_gradients_equal_plain_with_dropout_and_tracker():
    plain = _grads("plain")
    assert _same(plain, _grads("checkpoint"))
    assert _same(plain, _grads("non_reentrant"))
    # Dropout really is active: another seed gives other gradients.
    assert not _same(plain, _grads("plain", seed=8))


def test_param_grads_when_no_input_requires_grad():
    plain = _grads("plain", x_requires_grad=False)
    assert _same(plain, _grads("checkpoint", x_requires_grad=False))


def test_rng_tracker_api():
    tracker = ck.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("a", 123)
    with pytest.raises(ConfigError, match="seed 123"):
        tracker.add("b", 123)
    with pytest.raises(ConfigError, match="not tracked"):
        with tracker.fork("missing"):
            pass
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    saved = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the stream advanced
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), second)
    ck.model_parallel_cuda_manual_seed(11)
    assert list(tracker.get_states()) == ["model-parallel-rng"]


def test_cpu_checkpointing_keeps_no_reference_to_device_tensors():
    def run(cpu: bool):
        ck.configure(checkpoint_in_cpu=cpu)
        torch.manual_seed(0)
        block = Block()
        x = torch.randn(4, 5, H, requires_grad=True)
        h = x * 2  # a non-leaf activation, like a previous layer's output
        ref = weakref.ref(h)
        ck.model_parallel_cuda_manual_seed(1)
        out = ck.checkpoint(block, h)
        del h
        gc.collect()
        alive = ref() is not None
        holders = [r() for r in ckmod.STATE.live if r() is not None]
        kept = [e for hd in holders for e in hd.flat if isinstance(e, (torch.Tensor, HostCopy))]
        out.sum().backward()
        return alive, kept, x.grad.clone()

    alive, kept, grad_off = run(cpu=True)
    assert not alive, "cpu_checkpointing must not keep the compute-device input alive"
    assert kept and all(isinstance(e, HostCopy) and e.host.device.type == "cpu" for e in kept)
    alive_plain, _, grad_plain = run(cpu=False)
    assert alive_plain  # without it the checkpoint holds the input, as torch's does
    assert torch.equal(grad_off, grad_plain)


def test_partition_without_model_parallelism_logs_reason():
    records, handler = _capture_logs()
    try:
        ck.configure(partition_activations=True)
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    assert any("nothing to be split" in r.getMessage() for r in records)
    assert _same(_grads("plain"), _grads("checkpoint"))


def test_contiguous_buffer_holds_every_checkpoint_and_checks_its_size():
    ck.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    torch.manual_seed(0)
    model = Stack(3, "checkpoint")
    x = torch.randn(4, 5, H, requires_grad=True)
    ck.model_parallel_cuda_manual_seed(7)
    out = model(x)
    holders = [r() for r in ckmod.STATE.live if r() is not None]
    storages = {e.part.untyped_storage().data_ptr() for h in holders for e in h.flat
                if isinstance(e, ckmod._Partitioned)}
    assert len(holders) == 3 and len(storages) == 1  # three slots of one allocation
    out.square().mean().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    ck.configure()
    assert _same(_grads("plain"), got)
    ck.configure(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ConfigError, match="number_checkpoints=2"):
        Stack(3, "checkpoint")(torch.randn(2, 5, H, requires_grad=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(contiguous_checkpointing=True, num_checkpoints=4), "needs partition_activations"),
    (dict(partition_activations=True, contiguous_checkpointing=True), "needs number_checkpoints"),
    (dict(num_checkpoints=0), "positive integer"),
])
def test_bad_combinations_raise(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ck.configure(**kwargs)


def test_bad_values_in_config_section():
    with pytest.raises(ConfigError, match="true or false"):
        ck.configure(deepspeed_config={"activation_checkpointing": {"profile": "yes"}})
    with pytest.raises(ConfigError, match="did you mean 'cpu_checkpointing'"):
        ck.configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})


def test_synchronize_and_profile_have_observable_effects():
    ck.configure(synchronize=True, profile=True)
    _grads("checkpoint", n=3)
    # Start and end of each forward and each recompute.
    assert ckmod.STATE.sync_calls == 3 * 4
    records = ck.get_profile()
    assert [r.index for r in records] == [0, 1, 2]
    assert all(r.forward_s > 0 and r.recompute_s is not None and r.saved_input_bytes > 0 for r in records)
    ck.reset()
    assert ck.get_profile() == () and ckmod.STATE.sync_calls == 0


def test_configure_from_dict_path_and_overrides(tmp_path):
    cfg = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                        "number_checkpoints": 4}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    settings = ck.configure(deepspeed_config=str(path), checkpoint_in_cpu=False)
    assert ck.is_configured()
    assert settings.partition_activations and not settings.cpu_checkpointing
    assert settings.number_checkpoints == 4 and ckmod.STATE.settings.number_checkpoints == 4
    with pytest.raises(ConfigError, match="no such file"):
        ck.configure(deepspeed_config=str(tmp_path / "missing.json"))


def test_configure_from_engine_wraps_modules_and_reports():
    model = Stack(3, "plain")
    ac = types.SimpleNamespace(partition_activations=False, contiguous_memory_optimization=False,
                               cpu_checkpointing=True, number_checkpoints=None,
                               synchronize_checkpoint_boundary=False, profile=False,
                               modules=["Block"], policy="full")
    plan = ck.configure_from_engine(ac, model)
    assert plan.wrapped == ("blocks.0", "blocks.1", "blocks.2") and plan.settings.cpu_checkpointing
    with pytest.raises(Exception):
        plan.policy = "selective"  # frozen
    ac.modules = ["NoSuchLayer"]
    with pytest.raises(ConfigError, match="Block"):
        ck.configure_from_engine(ac, Stack(1, "plain"))
    ac.modules, ac.policy = ["Block"], "sometimes"
    with pytest.raises(ConfigError, match="policy='sometimes'"):
        ck.configure_from_engine(ac, Stack(1, "plain"))


def _partition_worker(rank: int, world_size: int):
    from shardwise.activation.api import WorldMPU
    ck.configure(mpu_=WorldMPU(), partition_activations=True)
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 6, H, requires_grad=True)
    ck.model_parallel_cuda_manual_seed(3, mp_rank=0)
    out = ck.checkpoint(block, x * 1.0)
    holder = [r() for r in ckmod.STATE.live if r() is not None][-1]
    parts = [e for e in holder.flat if isinstance(e, ckmod._Partitioned)]
    kept = parts[0].nbytes
    out.square().sum().backward()
    got = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    ck.configure()
    torch.manual_seed(0)
    block2 = Block()
    x2 = torch.randn(4, 6, H, requires_grad=True)
    ck.model_parallel_cuda_manual_seed(3, mp_rank=0)
    block2(x2 * 1.0).square().sum().backward()
    want = [p.grad for p in block2.parameters()] + [x2.grad]
    return kept, x.numel() * 4, all(torch.equal(a, b) for a, b in zip(got, want))


def test_partition_activations_splits_across_model_parallel_group():
    results = run_distributed(_partition_worker, 2)
    for kept, full, equal in results:
        assert kept == full // 2
        assert equal
