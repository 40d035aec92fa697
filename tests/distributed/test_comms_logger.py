"""The comms logger at world size 2 (gloo): the engine's collectives (stage 0 all-reduce,
ZeRO-2 reduce-scatter / all-gather, stage 3 per-parameter gathers) are listed with their
byte counts. (Filtering, formulas and the table: tests/unit/test_comms_logger.py.)"""
from __future__ import annotations

import math

from tests.dist_utils import run_distributed

STEPS = 2


def _train(rank: int, stage: int, logger: dict, zero_extra: dict = None, **extra):
    import shardwise
    from shardwise import comm
    from tests.distributed._parity import engine_config, global_batches, make_model
    cfg = engine_config(stage=stage, micro=2, ga=1, clip=0.0, lr=1e-2, comms_logger=logger,
                        zero_optimization=zero_extra or {}, **extra)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    comm.reset_log()
    for x, y in global_batches(STEPS, 4):
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
    summary = comm.log_summary(return_dict=True)["summary"]
    engine.destroy()
    comm.configure(enabled=False, prof_all=True, prof_ops=[])
    counts = {op: {size: rec["count"] for size, rec in by_size.items()}
              for op, by_size in summary.items()}
    if "flops_profiler" in extra:
        result = engine._profile.result
        return counts, (result.macs, result.params) if result is not None else None
    return counts


def _worker(rank: int, world: int):
    on = {"enabled": True}
    return {"stage0": _train(rank, 0, on),
            "stage2": _train(rank, 2, on),
            # the flops profiler at the same time: counting under stage 3's gathers (rank 0)
            "stage3": _train(rank, 3, on, {"stage3_param_persistence_threshold": 0},
                             flops_profiler={"enabled": True, "profile_step": 1,
                                             "detailed": False})}


def _bytes(by_size: dict) -> int:
    return sum(size * count for size, count in by_size.items())


def test_engine_collectives_are_listed_with_their_byte_counts() -> None:
    from tests.distributed._parity import HID, IN, OUT, make_model
    params = [p.numel() for p in make_model().parameters()]
    n_bytes = 4 * sum(params)  # fp32 gradients / weights of the whole model
    for rank, res in enumerate(run_distributed(_worker, 2)):
        # stage 0: every gradient is all-reduced once per step, in buckets
        assert set(res["stage0"]) == {"all_reduce"}
        assert _bytes(res["stage0"]["all_reduce"]) == STEPS * n_bytes
        # ZeRO-2: buckets are reduce-scattered (whole input) and the updated halves gathered
        # (this rank's input); one 4-byte all-reduce per step sums the gradient norm
        s2 = res["stage2"]
        assert set(s2) == {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"}
        assert _bytes(s2["reduce_scatter_tensor"]) == STEPS * n_bytes
        assert _bytes(s2["all_gather_into_tensor"]) == STEPS * n_bytes // 2
        assert s2["all_reduce"] == {4: STEPS}
        # ZeRO-3: per-parameter gathers of this rank's shard, per-parameter reduce-scatters
        s3, profiled = res["stage3"]
        assert profiled == ((2 * (IN * HID + HID * HID + HID * OUT), sum(params)) if rank == 0
                            else None)
        shards = {4 * math.ceil(n / 2) for n in params}
        assert set(s3["all_gather_into_tensor"]) == shards
        assert _bytes(s3["reduce_scatter_tensor"]) == STEPS * 4 * sum(2 * math.ceil(n / 2)
                                                                      for n in params)
        assert s3["all_reduce"] == {4: STEPS}
