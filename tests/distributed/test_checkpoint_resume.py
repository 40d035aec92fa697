"""Bit-exact resume through a real engine on 2 gloo ranks, and crash safety of a save.

Resume: train 10 steps, save, train 10 more (reference); then a freshly initialised engine
loads the checkpoint and trains the same 10: parameters and losses must be identical. The
model has dropout (so the RNG state must come back) and the data comes from the engine's
data loader (so its position must come back). One fp16 run with a scheduler checks that the
loss scaler and the scheduler survive too.

Crash safety: a subprocess saves tag A, then saves tag B and dies (``os._exit``) after a
chosen file of B; ``latest`` must still name A and A must load.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(48, 8, generator=gen),
                                          torch.randn(48, 4, generator=gen))


def _config(stage: int, fp16: bool, async_save: bool = False, offload: bool = False) -> dict:
    cfg = {"checkpoint": {"async_save": async_save},"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200,
                                 "stage3_param_persistence_threshold": 0},
           "gradient_clipping": 1.0}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if fp16:
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8,
                       "loss_scale_window": 3, "hysteresis": 1}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                          "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 15}}
    return cfg


def _engine(stage: int, fp16: bool, seed: int, async_save: bool = False, offload: bool = False):
    import shardwise
    torch.manual_seed(seed)
    engine, _, loader, _ = shardwise.initialize(model=Net(), config=_config(stage, fp16, async_save, offload),
                                                training_data=_dataset())
    return engine, loader


def _batches(loader):
    """Endless micro batches; lazy, so a position loaded before the first ``next`` is honoured."""
    while True:
        yield from loader


def _train(engine, steps: int):
    """``steps`` optimizer steps (GA=2 micro batches each); returns the micro-batch losses.

    The data of micro step m on rank r comes from its own seeded generator, so it does not
    touch the global RNG, which only dropout uses: equal losses after a resume prove the
    RNG state came back. (A torch DataLoader draws from the global RNG each time an iterator
    is created, so the loader's own position is checked separately below.)
    """
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        gen = torch.Generator().manual_seed(1000 * engine.micro_steps + engine.global_rank)
        x, y = torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().item())
    return losses


def _params(engine):
    return [p.detach().float().clone() for p in engine.module.parameters()]


def _resume_worker(rank: int, world: int, root: str, cases):
    from shardwise.errors import CheckpointError
    results = {}
    engine, _ = _engine(1, False, seed=1)
    engine.config.checkpoint.tag_validation = "Fail"
    try:  # ranks disagreeing on the tag: every rank raises, nothing is written
        engine.save_checkpoint(Path(root) / "badtag", tag=f"t{rank}")
        results["tag_fail"] = "no error"
    except CheckpointError as exc:
        results["tag_fail"] = "differs across ranks" in str(exc)
    for case in cases:
        stage, fp16, async_save, offload = case
        save_dir = Path(root) / "-".join(str(int(c)) for c in case)
        engine, loader = _engine(stage, fp16, seed=1, async_save=async_save, offload=offload)
        batches = _batches(loader)
        for _ in range(15):  # 12 batches per epoch per rank: stop mid-way through epoch 2
            next(batches)
        _train(engine, 10)
        engine.save_checkpoint(save_dir, client_state={"epoch": 3, "vec": torch.arange(100.0)})
        scaler_at_save = engine.optimizer.loss_scaler.state_dict() if fp16 else None
        sched_at_save = engine.lr_scheduler.state_dict() if engine.lr_scheduler else None
        loader_at_save = loader.state_dict()
        next_batch = next(batches)
        ref_losses = _train(engine, 10)
        ref_params = _params(engine)

        if async_save:  # the background write must not see the updates made meanwhile
            from shardwise.checkpoint.async_save import wait_pending
            wait_pending(engine)
        engine2, loader2 = _engine(stage, fp16, seed=99, offload=offload)  # other init and RNG
        torch.manual_seed(1234)
        path, client = engine2.load_checkpoint(save_dir)
        restored = {
            "path_ok": path.endswith("global_step10"),
            "client_ok": client["epoch"] == 3 and torch.equal(client["vec"], torch.arange(100.0)),
            "steps": (engine2.global_steps, engine2.global_samples, engine2.micro_steps),
            "scaler_ok": (engine2.optimizer.loss_scaler.state_dict() == scaler_at_save) if fp16 else True,
            "sched_ok": (engine2.lr_scheduler.state_dict() == sched_at_save) if sched_at_save else True,
            "loader_ok": loader2.state_dict()["epoch"] == loader_at_save["epoch"] == 1,
        }
        rng = torch.get_rng_state()
        batch2 = next(_batches(loader2))
        torch.set_rng_state(rng)  # the iterator creation drew from the global RNG
        restored["batch_ok"] = all(torch.equal(a, b) for a, b in zip(batch2, next_batch))
        losses = _train(engine2, 10)
        params = _params(engine2)
        results[case] = {
            **restored,
            "losses_equal": losses == ref_losses,
            "params_equal": all(torch.equal(a, b) for a, b in zip(params, ref_params)),
        }
    return results


def test_bit_exact_resume_stages_0_1_2_3_offload_fp16_async(tmp_path):
    # (stage, fp16, async_save, offload_optimizer)
    cases = [(0, False, False, False), (1, False, False, False), (2, False, False, False),
             (2, True, False, False), (1, False, True, False), (2, False, False, True),
             (3, False, False, False), (3, True, False, True)]
    per_rank = run_distributed(_resume_worker, 2, str(tmp_path), cases)
    assert not (tmp_path / "badtag").exists()
    for rank, results in enumerate(per_rank):
        assert results.pop("tag_fail") is True
        assert sorted(results) == sorted(cases)
        for case, res in results.items():
            assert res["path_ok"] and res["client_ok"], (rank, case, res)
            assert res["steps"] == (10, 10 * 8, 20), (rank, case, res)
            assert res["scaler_ok"] and res["sched_ok"], (rank, case, res)
            assert res["loader_ok"] and res["batch_ok"], (rank, case, res)
            assert res["losses_equal"], (rank, case)
            assert res["params_equal"], (rank, case)


# --------------------------------------------------------------------------- crash safety

_KILL_SCRIPT = textwrap.dedent("""
    import sys, torch, shardwise
    from safetensors.torch import save_file
    sys.path.insert(0, {root!r})
    from tests.distributed.test_checkpoint_resume import Net, _config, _dataset, _train
    torch.manual_seed(0)
    engine, _, loader, _ = shardwise.initialize(model=Net(), config=_config(1, False),
                                                training_data=_dataset())
    _train(engine, 2)
    engine.save_checkpoint({save!r}, tag="A")
    save_file({{n: p.detach().float().clone() for n, p in engine.module.named_parameters()}},
              {ref!r})
    _train(engine, 2)
    engine.save_checkpoint({save!r}, tag="B")
    print("SAVED-B")
""")


def test_killed_save_leaves_previous_tag_loadable(tmp_path):
    from safetensors.torch import load_file

    from shardwise.checkpoint import CheckpointReader, available_tags, get_fp32_state_dict

    files_of_a = 4  # rank file, rank index, metadata, latest (one rank)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHARDWISE_LOG_LEVEL": "warning"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    for die_after in (1, 3):  # after B's data file; after its metadata, before the rename
        save, ref = tmp_path / f"ck{die_after}", tmp_path / f"ref{die_after}.safetensors"
        script = _KILL_SCRIPT.format(root=str(ROOT), save=str(save), ref=str(ref))
        env["SHARDWISE_CKPT_TEST_DIE_AFTER_FILES"] = str(files_of_a + die_after)
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1 and "SAVED-B" not in proc.stdout, proc.stderr[-2000:]
        assert (save / "latest").read_text() == "A"
        assert available_tags(save) == ["A"]
        with CheckpointReader(save) as reader:
            assert reader.tag == "A"
        state = get_fp32_state_dict(save)
        expected = load_file(str(ref))
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
    # without the hook the same script completes, replacing the stale partial folder
    env.pop("SHARDWISE_CKPT_TEST_DIE_AFTER_FILES")
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT.format(
        root=str(ROOT), save=str(tmp_path / "ck3"), ref=str(tmp_path / "ref3.safetensors"))],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SAVED-B" in proc.stdout, proc.stderr[-2000:]
    assert (tmp_path / "ck3" / "latest").read_text() == "B"
    assert available_tags(tmp_path / "ck3") == ["A", "B"]
    assert not [p for p in (tmp_path / "ck3").iterdir() if p.name.startswith(".")]
