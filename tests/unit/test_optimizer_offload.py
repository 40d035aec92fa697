"""ZeRO-Offload for stages 1-2 in one process: parity with torch (eager CPU step, step after
backward, partial offload), the delayed parameter update against its definition, and flat
host memory over hundreds of steps."""
from __future__ import annotations

import gc

import psutil
import pytest
import torch

import shardwise
from tests.distributed._parity import (dpu_reference, engine_config, global_batches, make_model,
                                       max_rel_diff, reference_params, train_engine)


def _offload(**opts):
    return {"stage": 2, "reduce_bucket_size": 200,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, **opts}}


@pytest.mark.parametrize("clip,ga,opts", [
    (0.0, 1, {}),               # eager: buckets stepped on the CPU during backward
    (0.05, 2, {}),              # clipping needs the global norm: step after backward
    (0.0, 2, {"ratio": 0.5}),   # half of the optimizer stays on the compute device
])
def test_offload_matches_torch_reference(clip, ga, opts) -> None:
    cfg = engine_config(2, 2, ga, clip, 1e-2, zero_optimization=_offload(**opts))
    got = train_engine(0, 1, cfg, steps=10)
    assert not max_rel_diff(got, reference_params(10, 2 * ga, 1e-2, clip))


def test_offload_places_masters_by_ratio_and_is_eager_only_when_it_may_be() -> None:
    engine, *_ = shardwise.initialize(model=make_model(), config=engine_config(
        2, 2, 1, 0.0, 1e-2, zero_optimization=_offload(ratio=0.5)))
    offloaded = [b.offloaded for b in engine.strategy.buckets]
    assert any(offloaded) and not all(offloaded)
    assert not engine.strategy.eager
    engine2, *_ = shardwise.initialize(model=make_model(), config=engine_config(
        2, 2, 1, 0.0, 1e-2, zero_optimization=_offload()))
    assert engine2.strategy.eager
    engine3, *_ = shardwise.initialize(model=make_model(), config=engine_config(
        2, 2, 1, 1.0, 1e-2, zero_optimization=_offload()))
    assert not engine3.strategy.eager  # clipping needs every gradient first


@pytest.mark.parametrize("warmup", [0, 3])
def test_delayed_parameter_update_is_one_step_stale_exactly(warmup: int) -> None:
    steps = 8
    cfg = engine_config(2, 4, 1, 0.0, 1e-2, zero_optimization=_offload(
        delayed_update=True, delayed_update_warmup=warmup))
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    losses = []
    for x, y in global_batches(steps, 4):
        loss = engine(x, y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    views = {v.name: v for v in engine.shard_views()}  # flushes the last delayed update
    ref = dpu_reference([1e-2] * steps, 4, warmup)
    for name, want in ref.items():
        got = views[name].master.view(want.shape).cpu()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(views[name].param.detach().cpu(), want, rtol=1e-5, atol=1e-6), name
    # and it really is stale: without the delay the parameters differ
    plain = train_engine(0, 1, engine_config(2, 4, 1, 0.0, 1e-2), steps)
    assert max_rel_diff(plain, {k: v for k, v in ref.items()})


@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_update_steps_at_the_rate_of_its_own_step_while_the_scheduler_moves_on(stage) -> None:
    """The background step must use the learning rate of the step that produced it, though
    the scheduler writes the next rate as soon as engine.step() returns (a step pre-hook
    holds the background step back, so the scheduler has always written it by then)."""
    import time
    steps = 6
    zero = _offload(delayed_update=True)
    if stage == 3:  # weights partitioned, biases persistent: both delayed
        zero.update(stage=3, stage3_param_persistence_threshold=30)
    cfg = engine_config(2, 4, 1, 0.0, 1e-2, zero_optimization=zero,
                        scheduler={"type": "WarmupLR", "params": {
                            "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                            "warmup_type": "linear"}})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    engine.optimizer.inner.register_step_pre_hook(lambda opt, args, kwargs: time.sleep(0.05))
    lrs = []
    for x, y in global_batches(steps, 4):
        lrs.append(engine.get_lr()[0])
        engine.backward(engine(x, y))
        engine.step()
    assert len(set(lrs)) > 3  # the rate really changes from step to step
    views = {v.name: v for v in engine.shard_views()}
    for name, want in dpu_reference(lrs, 4, 0).items():
        got = views[name].master.view(want.shape).cpu()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name


OFF = {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("zero", [
    {"stage": 2, "offload_optimizer": OFF},
    {"stage": 2, "offload_optimizer": {**OFF, "delayed_update": True}},
    {"stage": 3, "stage3_param_persistence_threshold": 300, "offload_param": OFF,
     "offload_optimizer": {**OFF, "delayed_update": True}},
], ids=["z2", "z2-dpu", "z3-both-dpu"])
def test_host_memory_stays_flat_over_hundreds_of_steps(zero) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"reduce_bucket_size": 50_000, **zero}})
    x = torch.randn(8, 256)
    proc = psutil.Process()
    strategy = engine.strategy

    def host_buffers() -> set:
        if zero["stage"] == 2:
            return {id(b.master_grad) for b in strategy.buckets}
        # DPU alternates two gradient sets: both stay the same two
        return {id(g) for g in strategy.masters.flat_grad + strategy.masters.spare_flat_grad
                + strategy.masters.flat_master}

    buffers = host_buffers()
    rss = []
    for step in range(600):  # 300 optimizer steps
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        if step in (100, 599):
            gc.collect()
            rss.append(proc.memory_info().rss)
    assert host_buffers() == buffers  # reused, never reallocated
    assert rss[1] - rss[0] < 8 * 2**20, f"RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"


def test_destroy_flushes_a_delayed_update_and_removes_hooks() -> None:
    cfg = engine_config(2, 4, 1, 0.0, 1e-2, zero_optimization=_offload(delayed_update=True))
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    for x, y in global_batches(3, 4):
        engine.backward(engine(x, y))
        engine.step()
    bucket = engine.strategy.buckets[0]
    engine.destroy()
    # the last CPU update reached the parameters
    assert torch.equal(bucket.param_buf[bucket.lo:bucket.hi].float(), bucket.master)
    x, y = global_batches(1, 4)[0]
    engine.module(x, y).backward()  # hooks gone: plain autograd, no bucket accumulation
    assert float(bucket.grad_buf.abs().sum()) == 0.0


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_host_accumulation_matches_device_accumulation_and_frees_device_grads(clip) -> None:
    """bf16 model, accumulation over 3 micro steps: with host accumulation each bucket's
    gradients go to the pinned partition every micro step and the device buffer is freed;
    the result equals accumulating in an fp32 buffer on the device and copying once (the
    same CPU optimizer either way; fp32 adds commute, so the sums are bit-identical)."""
    results = {}
    for host in (False, True):
        cfg = engine_config(2, 2, 3, clip, 1e-2, bf16={"enabled": True},
                            zero_optimization=_offload())
        engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
        assert engine.strategy.host_accumulate  # the default for offloaded bf16 models
        engine.strategy.host_accumulate = host
        for x, y in global_batches(4, 6):
            for k in range(3):
                sl = slice(2 * k, 2 * k + 2)
                engine.backward(engine(x[sl].to(engine.device, torch.bfloat16),
                                       y[sl].to(engine.device, torch.bfloat16)).float())
                if k < 2:
                    sizes = [b.grad_buf.untyped_storage().size() for b in engine.strategy.buckets]
                    # host accumulation: nothing accumulates on the device mid-window
                    assert (sizes == [0] * len(sizes)) is host, sizes
                engine.step()
        results[host] = {k: v.float().cpu().clone() for k, v in engine.module.state_dict().items()}
        assert engine.get_global_grad_norm() > 0
    for k, v in results[False].items():
        torch.testing.assert_close(results[True][k], v, rtol=0, atol=0, msg=k)
