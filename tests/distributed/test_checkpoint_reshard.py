"""Resharding through real engines: 2 ranks stage 2 → 4 ranks stage 3 with CPU optimizer
offload (stage 1 with offload while stage 3 is absent) → 1 rank stage 1.

Each hop loads the previous checkpoint and immediately re-saves it: the consolidated fp32
weights and every optimizer state must come out bit-identical. Then each hop trains a few
steps on the same global batches as a reference run that never left 2 ranks: the
parameters must agree to fp32 rounding (the reduction order differs between world sizes,
so bitwise equality is not expected there).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.dist_utils import run_distributed

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 24)
        self.fc2 = torch.nn.Linear(24, 24)
        self.fc3 = torch.nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _engine(world: int, stage: int, offload: bool = False):
    import shardwise
    micro = 2
    ga = GLOBAL_BATCH // (micro * world)
    zero = {"stage": stage, "reduce_bucket_size": 150,
            "stage3_param_persistence_threshold": 0,  # partition even these tiny layers
            "stage3_gather_16bit_weights_on_model_save": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
           "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
           "zero_optimization": zero}
    torch.manual_seed(0)
    engine, *_ = shardwise.initialize(model=Net(), config=cfg)
    return engine


def _train(engine, steps: int):
    """Global batch of step s is fixed; each rank takes its micro batches out of it, so any
    world size computes the same mean gradient."""
    world, rank = engine.world_size, engine.global_rank
    micro, ga = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for _ in range(steps):
        gen = torch.Generator().manual_seed(engine.global_steps)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)
        for k in range(ga):
            lo = (k * world + rank) * micro
            loss = torch.nn.functional.mse_loss(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()


def _full_params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _first_hop(rank, world, root):
    engine = _engine(world, stage=2)
    _train(engine, 5)
    engine.save_checkpoint(Path(root) / "a")
    engine.save_16bit_model(Path(root) / "export_a", "pytorch_model.bin")
    _train(engine, 3)
    return _full_params(engine)


def _middle_hop(rank, world, root):
    engine = _engine(world, stage=3, offload=True)
    engine.load_checkpoint(Path(root) / "a")
    steps = (engine.global_steps, engine.micro_steps)
    engine.save_16bit_model(Path(root) / "export_b")  # gathered from 4 stage-3 shards
    engine.save_checkpoint(Path(root) / "b")
    _train(engine, 3)
    engine.save_checkpoint(Path(root) / "b_trained")
    return steps


def _last_hop(rank, world, root):
    engine = _engine(world, stage=1)
    engine.load_checkpoint(Path(root) / "b")
    engine.save_checkpoint(Path(root) / "c")
    _train(engine, 3)
    return _full_params(engine)


def _all_tensors(checkpoint_dir):
    """Every stored (kind, parameter) as a full flat tensor; weights and masters included."""
    from shardwise.checkpoint import CheckpointReader
    with CheckpointReader(checkpoint_dir) as reader:
        return {(kind, name): reader.read_range(kind, name)
                for name in reader.params for kind in reader.kinds(name)}, reader.meta


def test_reshard_2_to_4_to_1_across_stages(tmp_path):
    from shardwise.checkpoint import get_fp32_state_dict

    reference = run_distributed(_first_hop, 2, str(tmp_path))[0]
    steps = run_distributed(_middle_hop, 4, str(tmp_path))
    assert steps == [(5, 5)] * 4  # GA 2 -> 1: micro steps re-counted in whole steps
    four_rank_trained = get_fp32_state_dict(tmp_path / "b_trained")
    final = run_distributed(_last_hop, 1, str(tmp_path))[0]

    from safetensors.torch import load_file
    fp32_a = get_fp32_state_dict(tmp_path / "a")
    exported = (torch.load(tmp_path / "export_a" / "pytorch_model.bin", weights_only=True),
                load_file(str(tmp_path / "export_b" / "model.safetensors")))
    for state in exported:
        assert state.keys() == fp32_a.keys()
        assert all(torch.equal(state[k], fp32_a[k]) for k in fp32_a)

    a, meta_a = _all_tensors(tmp_path / "a")
    for hop in ("b", "c"):
        other, meta = _all_tensors(tmp_path / hop)
        for key in ("global_steps", "global_samples", "skipped_steps"):
            assert meta["counters"][key] == meta_a["counters"][key]
        assert {k for k in other if k[0] != "weight"} == {k for k in a if k[0] != "weight"}
        for key, value in a.items():
            assert torch.equal(other[key], value), (hop, key)
    assert meta_a["world_size"] == 2 and meta_a["zero_stage"] == 2
    assert _all_tensors(tmp_path / "b")[1]["world_size"] == 4

    for name, ref in reference.items():
        torch.testing.assert_close(four_rank_trained[name], ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final[name], ref, rtol=1e-5, atol=1e-6)
        assert not torch.equal(ref, get_fp32_state_dict(tmp_path / "a")[name])  # training moved it
