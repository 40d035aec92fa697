"""The engine on a CUDA device: parity with torch for stages 0-2 (fp32), offload and DPU on
real pinned memory and side streams, bf16, and multi-rank gloo runs sharing one GPU so every
collective path runs on CUDA tensors."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed._parity import engine_config, max_rel_diff, reference_params, train_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_cases(rank: int, world: int):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for stage, ga, clip in [(0, 1, 0.0), (1, 2, 0.05), (2, 3, 0.05)]:
        out[(stage, ga, clip, "plain")] = train_engine(rank, world, engine_config(stage, 2, ga, clip, 1e-2), 10)
    import os
    # clip 1e6 never clips but turns the eager CPU step off: both offload paths are covered,
    # through the native collectives and the all-reduce fallbacks
    for fallback in ("0", "1"):
        os.environ["SHARDWISE_COMM_FALLBACK"] = fallback
        for stage, ga, clip, ratio in [(1, 1, 0.0, 1.0), (1, 1, 1e6, 1.0), (2, 2, 0.05, 1.0),
                                       (2, 1, 0.0, 0.5)]:
            cfg = engine_config(stage, 2, ga, clip, 1e-2, zero_optimization={
                "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": ratio}})
            out[(stage, ga, clip, f"offload{ratio}-fb{fallback}")] = train_engine(rank, world, cfg, 10)
    return {k: {n: t.cpu() for n, t in v.items()} for k, v in out.items()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_cuda_stages_and_offload_match_reference(world: int) -> None:
    per_rank = run_distributed(_cuda_cases, world)
    failures = []
    for key in per_rank[0]:
        stage, ga, clip, _ = key
        ref = reference_params(10, 2 * ga * world, 1e-2, clip)
        for rank, res in enumerate(per_rank):
            bad = max_rel_diff(res[key], ref)
            if bad:
                failures.append((key, rank, bad[:2]))
    assert not failures, failures


def test_cuda_bf16_and_parameters_live_on_the_gpu() -> None:
    import shardwise
    from tests.distributed._parity import make_model
    cfg = engine_config(2, 4, 1, 0.0, 1e-2, bf16={"enabled": True},
                        zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memory": True}})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    p = next(engine.module.parameters())
    assert p.is_cuda and p.dtype == torch.bfloat16
    views = engine.shard_views()
    assert all(v.master.device.type == "cpu" for v in views if v.master is not None)
    bucket = engine.strategy.buckets[0]
    assert bucket.master.is_pinned() and bucket.master_grad.is_pinned()


def test_cuda_offloaded_bf16_model_holds_only_its_weights_before_training() -> None:
    """ZeRO-2 + optimizer offload of a bf16 model: after initialize the GPU holds the bf16
    weights and the 64 MiB staging buffer, no gradient buffer (the first forward's peak)."""
    import shardwise
    from shardwise.offload.optimizer_offload import STAGING_ELEMS
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    cfg = engine_config(2, 4, 2, 0.0, 1e-2, bf16={"enabled": True},
                        zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memory": True}})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    n = sum(p.numel() for p in engine.module.parameters())
    staging = min(STAGING_ELEMS, max(b.hi - b.lo for b in engine.strategy.buckets)) * 4
    held = torch.cuda.memory_allocated() - before
    assert held <= 2 * n + staging + (1 << 20), (held, 2 * n, staging)
    engine.destroy()



def test_cuda_delayed_update_matches_its_definition() -> None:
    """The same exact-staleness check as on the CPU, with real streams and pinned copies."""
    from tests.unit.test_optimizer_offload import test_delayed_parameter_update_is_one_step_stale_exactly
    torch.backends.cuda.matmul.allow_tf32 = False
    test_delayed_parameter_update_is_one_step_stale_exactly(warmup=2)


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _stage3_cuda_cases(rank: int, world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from tests.distributed.test_zero3_parity import _all_cases
    return _to_cpu(_all_cases(rank, world, False))


@pytest.mark.parametrize("world", [1, 2])
def test_cuda_stage3_and_offload_match_reference(world: int) -> None:
    """Stage 3 on CUDA: side-stream shard fetches (offload_param), the pinned gradient ring
    and the worker's eager CPU steps (offload_optimizer) against the torch reference."""
    from tests.distributed.test_zero3_parity import _check
    per_rank = run_distributed(_stage3_cuda_cases, world)
    _check(per_rank, world)


def test_cuda_host_accumulation_matches_device_accumulation() -> None:
    """Stage-2 offload of a bf16 model streams each bucket to pinned memory every micro step
    (side stream, device buffer freed after the copy); same result as device accumulation."""
    from tests.unit.test_optimizer_offload import (
        test_host_accumulation_matches_device_accumulation_and_frees_device_grads as check)
    torch.backends.cuda.matmul.allow_tf32 = False
    check(0.0)
    check(0.05)


@pytest.mark.gpu
def test_large_pinned_blocks_are_not_rounded_up() -> None:
    """Offload's flat buffers are pinned at their exact size: a block just over 96 MiB would
    take 128 MiB of locked RAM with the host allocator's power-of-two rounding."""
    from shardwise.accelerator import get_accelerator
    from shardwise.accelerator.base import exact_large_pinned_blocks

    get_accelerator().pin_memory(torch.empty(8))  # applies the setting on first use
    if not exact_large_pinned_blocks("cuda"):
        pytest.skip("this torch has no pinned_max_round_threshold_mb setting")
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    nbytes = (96 << 20) + 4096
    t = get_accelerator().pin_memory(torch.empty(nbytes // 4))
    assert t.is_pinned()
    grown = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    assert nbytes <= grown < (128 << 20), grown


def _stage3_offload_norms(cfg: dict, steps: int) -> list:
    """get_global_grad_norm() after each step of a one-process stage-3 run."""
    import shardwise
    from tests.distributed._parity import global_batches, make_model
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    micro, ga = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    norms = []
    for x, y in global_batches(steps, micro * ga):
        for k in range(ga):
            engine.backward(engine(x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return norms


@pytest.mark.parametrize("delayed", [False, True])
def test_cuda_stage3_offload_norm_summed_beside_the_copies_is_the_norm(delayed: bool) -> None:
    """Without clipping the step does not read the norm, so stage 3 with offload sums it on
    the copy stream (off the compute stream's path); it must equal the norm computed in
    stream order (clip 1e6: never clips, same update) and, at the first step, torch's."""
    from tests.distributed._parity import global_batches, make_model
    torch.backends.cuda.matmul.allow_tf32 = False
    offload = {"offload_param": {"device": "cpu", "pin_memory": True},
               "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                     "delayed_update": delayed},
               "stage3_param_persistence_threshold": 0}
    side = _stage3_offload_norms(engine_config(3, 2, 2, 0.0, 1e-2, zero_optimization=offload), 4)
    in_order = _stage3_offload_norms(engine_config(3, 2, 2, 1e6, 1e-2, zero_optimization=offload), 4)
    assert side == pytest.approx(in_order, rel=1e-5)
    model = make_model()
    x, y = global_batches(1, 4)[0]
    model(x, y).backward()
    first = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert side[0] == pytest.approx(first, rel=1e-4)
