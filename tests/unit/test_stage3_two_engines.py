"""Two ZeRO stage-3 engines in one process (an RLHF actor and a reference model): each has
its own gather context, so interleaving their forwards, backwards and steps changes nothing,
and each trains exactly like its own plain-torch reference."""
from __future__ import annotations

from typing import Dict, List

import torch

from tests.distributed._parity import engine_config, global_batches, make_model, max_rel_diff

STEPS, MICRO, GA = 3, 2, 2


def _reference(seed: int, lr: float, data_seed: int) -> Dict[str, torch.Tensor]:
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for x, y in global_batches(STEPS, MICRO * GA, seed=data_seed):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _engine(seed: int, lr: float, offload: bool):
    import shardwise
    zero = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 300,
            "stage3_max_reuse_distance": 0}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = shardwise.initialize(model=make_model(seed),
                                      config=engine_config(3, MICRO, GA, 0.0, lr, zero_optimization=zero))
    return engine


def _gathered(engine) -> List[str]:
    rec = engine.strategy.partitioner.record
    return sorted(n for n, p in engine.module.named_parameters() if rec(p).status != "released")


def test_two_stage3_engines_train_side_by_side() -> None:
    from shardwise.zero import GatheredParameters
    specs = [(0, 1e-2, 1, False), (3, 3e-2, 5, True)]  # (model seed, lr, data seed, offload)
    engines = [_engine(seed, lr, offload) for seed, lr, _, offload in specs]
    data = [global_batches(STEPS, MICRO * GA, seed=ds) for _, _, ds, _ in specs]
    for step in range(STEPS):
        for k in range(GA):
            losses = []
            for engine, batches in zip(engines, data):
                x, y = batches[step]
                losses.append(engine(x[k * MICRO:(k + 1) * MICRO], y[k * MICRO:(k + 1) * MICRO]))
            kept = [_gathered(e) for e in engines]
            # the second engine's end-of-forward sweep left the first one's kept tail alone
            if step:
                assert kept[0], "engine 0 lost the parameters it keeps for its backward"
            for engine, loss in zip(engines, losses):
                engine.backward(loss)
            for engine in engines:
                engine.step()
    for engine, (seed, lr, ds, _) in zip(engines, specs):
        with GatheredParameters(list(engine.module.parameters())):
            got = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        bad = max_rel_diff(got, _reference(seed, lr, ds))
        assert not bad, (seed, bad)
        assert engine.strategy.gathers.live_numel == 0
        engine.destroy()
    assert engines[0].strategy.gathers is not engines[1].strategy.gathers
