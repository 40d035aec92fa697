"""The engine in one process (a world of one, no launcher): API surface, fp16 overflow
skipping step by step, bf16, schedulers stepping only on applied steps, bad input."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shardwise
from shardwise.errors import ConfigError, ZeroError
from tests.distributed._parity import (IN, OUT, engine_config, global_batches, make_model,
                                       max_rel_diff, reference_params, train_engine)


def _cfg(**extra):
    return engine_config(stage=2, micro=4, ga=1, clip=0.0, lr=1e-2, **extra)


def test_world_of_one_matches_reference_and_exposes_deepspeed_api() -> None:
    cfg = engine_config(stage=1, micro=2, ga=2, clip=0.1, lr=1e-2)
    got = train_engine(0, 1, cfg, steps=10)
    assert not max_rel_diff(got, reference_params(10, 4, 1e-2, 0.1))

    engine, opt, loader, sched = shardwise.initialize(model=make_model(), config=cfg)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (4, 2, 2)
    assert engine.world_size == 1 and engine.global_rank == 0 and engine.local_rank == 0
    assert loader is None and sched is None and opt is engine.optimizer
    assert opt.cur_scale == 1.0 and engine.get_lr() == [1e-2]
    x, y = global_batches(1, 4)[0]
    assert not engine.is_gradient_accumulation_boundary() or engine.micro_steps % 2 == 1
    engine.backward(engine(x[:2], y[:2]))
    engine.step()
    assert engine.micro_steps == 1 and engine.global_steps == 0 and not engine.was_step_applied()
    engine.backward(engine(x[2:], y[2:]))
    assert engine.is_gradient_accumulation_boundary()
    engine.step()
    assert engine.global_steps == 1 and engine.global_samples == 4 and engine.was_step_applied()
    assert engine.get_global_grad_norm() > 0
    assert engine.fc1 is engine.module.fc1  # attribute fall-through to the module
    engine.eval()
    assert not engine.module.training
    engine.train()
    assert engine.module.training


def test_initialize_compiles_nothing_and_is_fast_in_a_plain_process(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time, torch, shardwise
        t0 = time.perf_counter()
        model = torch.nn.Linear(4, 2)
        engine, opt, _, _ = shardwise.initialize(model=model, config={
            "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
        dt = time.perf_counter() - t0
        loss = engine(torch.ones(2, 4)).sum(); engine.backward(loss); engine.step()
        import torch.distributed as dist
        print("OK", dist.get_world_size(), engine.global_steps, f"{dt:.2f}")
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    ok, world, steps, seconds = out.stdout.split()[-4:]
    assert (ok, world, steps) == ("OK", "1", "1")
    assert float(seconds) < 10.0


def test_fp16_overflow_skips_steps_and_follows_the_scaler() -> None:
    cfg = _cfg(fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                     "hysteresis": 2, "min_loss_scale": 1},
               scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10,
                                                         "warmup_type": "linear"}})
    engine, opt, _, sched = shardwise.initialize(model=make_model(), config=cfg)
    assert next(engine.module.parameters()).dtype == torch.float16
    overflow_at = {1, 2, 5}
    expected_scale, hysteresis, last_overflow = 256.0, 2, -1
    lrs = []
    for step, (x, y) in enumerate(global_batches(8, 4)):
        before = [p.detach().clone() for p in engine.module.parameters()]
        loss = engine(x, y)
        if step in overflow_at:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        applied = step not in overflow_at
        assert engine.was_step_applied() == applied, step
        changed = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        assert changed == applied, step
        # DeepSpeed's rules, written out
        if not applied:
            if hysteresis == 1:
                expected_scale = max(expected_scale / 2, 1)
            else:
                hysteresis -= 1
            last_overflow = step
        elif (step - last_overflow) % 2 == 0:
            hysteresis = 2
            expected_scale *= 2
        assert opt.cur_scale == expected_scale, (step, opt.cur_scale, expected_scale)
        lrs.append(engine.get_lr()[0])
    assert engine.skipped_steps == 3 and engine.global_steps == 8
    # the scheduler stepped only on the 5 applied steps: linear warmup to step 5
    assert lrs[-1] == pytest.approx(1e-3 + 9e-3 * sched.last_batch_iteration / 10)
    assert sched.last_batch_iteration == 4


def test_bf16_trains_within_bf16_tolerance_of_fp32_reference() -> None:
    cfg = engine_config(stage=2, micro=4, ga=2, clip=0.0, lr=1e-2, bf16={"enabled": True})
    got = train_engine(0, 1, cfg, steps=10)
    ref = reference_params(10, 8, 1e-2, 0.0)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=0, atol=3e-2), k
    # the fp32 masters carry more precision than the bf16 weights they feed
    views = engine.shard_views()
    assert all(v.master.dtype == torch.float32 for v in views if v.master is not None)
    assert all(b.grad_buf.dtype == torch.float32 for b in engine.strategy.buckets)
    # before the first backward and between steps the fp32 gradient buffers hold no memory
    # (the activations may use it: the first forward is as high a peak as any later one)
    assert all(b.grad_buf.untyped_storage().size() == 0 for b in engine.strategy.buckets)
    x, y = global_batches(1, 8)[0]
    for k in range(2):
        engine.backward(engine(x[4 * k:4 * k + 4], y[4 * k:4 * k + 4]))
        if k == 0:  # inside the accumulation window the buffers are live
            assert all(b.grad_buf.untyped_storage().size() > 0 for b in engine.strategy.buckets)
        engine.step()
    assert all(b.grad_buf.untyped_storage().size() == 0 for b in engine.strategy.buckets)
    # data_types.grad_accum_dtype = bf16: half the gradient memory, still within bf16 tolerance
    cfg_bf16_acc = dict(cfg, data_types={"grad_accum_dtype": "bf16"})
    got2 = train_engine(0, 1, cfg_bf16_acc, steps=10)
    for k in ref:
        assert torch.allclose(got2[k], ref[k], rtol=0, atol=3e-2), k
    engine3, *_ = shardwise.initialize(model=make_model(), config=cfg_bf16_acc)
    assert all(b.grad_buf.dtype == torch.bfloat16 for b in engine3.strategy.buckets)


def test_no_sync_rules() -> None:
    engine, *_ = shardwise.initialize(model=make_model(), config=engine_config(1, 2, 2, 0.0, 1e-2))
    x, y = global_batches(1, 4)[0]
    with engine.no_sync():
        engine.backward(engine(x[:2], y[:2]))
        with pytest.raises(ZeroError, match="inside engine.no_sync"):
            engine.step()
    engine2, *_ = shardwise.initialize(model=make_model(), config=engine_config(2, 2, 2, 0.0, 1e-2))
    with pytest.raises(ZeroError, match="incompatible with ZeRO stage 2"):
        with engine2.no_sync():
            pass


def test_client_optimizer_and_scheduler_objects_and_callables() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, eopt, _, esched = shardwise.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                                   config={"train_batch_size": 4})
    assert eopt.inner is opt and esched is sched
    x, y = global_batches(1, 4)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert engine.get_lr() == [0.25]
    engine2, eopt2, _, esched2 = shardwise.initialize(
        model=make_model(), optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)),
        config={"train_batch_size": 4})
    assert isinstance(eopt2.inner, torch.optim.Adam) and esched2.get_last_lr() == [0.1]


def test_training_data_gives_a_micro_batch_loader() -> None:
    data = [{"x": torch.randn(IN), "y": torch.randn(OUT)} for _ in range(10)]
    engine, _, loader, _ = shardwise.initialize(model=make_model(), training_data=data,
                                                config=_cfg())
    batches = list(loader)
    assert [b["x"].shape[0] for b in batches] == [4, 4, 2]
    assert loader.state_dict() == {"epoch": 1, "position": 0}


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(config="/nonexistent/ds_config.json"), "ds_config.json"),
    (dict(config={"fp16": {"enabled": True}, "bf16": {"enabled": True}}), "both true"),
    (dict(config={"optimizer": {"type": "Adamm", "params": {}}}), "Adam"),
    (dict(config={"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}), "gradient_clipping"),
    (dict(config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}), "3"),
    (dict(config={"train_batch_size": 2}, model_parameters=[]), "no parameters"),
    (dict(config={"train_batch_size": 2}, optimizer="adam"), "torch.optim.Optimizer"),
    (dict(config={"train_batch_size": 2}, mpu=object()), "mpu"),
])
def test_bad_input_raises_a_clear_config_error(kwargs, pattern) -> None:
    with pytest.raises(ConfigError, match=pattern):
        shardwise.initialize(model=make_model(), **kwargs)


def test_backward_without_optimizer_says_how_to_fix() -> None:
    engine, opt, _, _ = shardwise.initialize(model=make_model(), config={"train_batch_size": 2})
    assert opt is None
    x, y = global_batches(1, 2)[0]
    with pytest.raises(ConfigError, match="needs an optimizer"):
        engine.backward(engine(x, y))
