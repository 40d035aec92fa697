"""Stage 3 on a CUDA device, the paths issue 19 reshaped: the parameters-only stage 3 with
offload_param (host shards fetched on the gather context's side stream) generating the plain
model's tokens, and two stage-3 engines with offload in one process, each matching its
reference (each engine's own fetch streams and live set)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed._hf_tiny import build
from tests.distributed._parity import engine_config, global_batches, make_model, max_rel_diff

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.tensor([[3, 14, 15, 9, 2]])
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_cuda_parameters_only_stage3_offload_generates_the_plain_tokens(kind: str) -> None:
    import shardwise
    from shardwise.zero.stage3.partition import record_of
    torch.backends.cuda.matmul.allow_tf32 = False
    plain = build(kind).cuda().eval()
    with torch.no_grad():
        want = plain.generate(PROMPT.cuda(), **GEN).cpu()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10,
            "stage3_prefetch_bucket_size": 3000,
            "offload_param": {"device": "cpu", "pin_memory": True}}
    engine, *_ = shardwise.initialize(model=build(kind), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    recs = [record_of(p) for p in engine.module.parameters() if record_of(p) is not None]
    assert recs and all(r.shard.device.type == "cpu" and r.shard.is_pinned() for r in recs)
    engine.eval()
    with torch.no_grad():
        for _ in range(2):  # the second run prefetches along the recorded eval order
            got = engine.module.generate(PROMPT.cuda(), **GEN).cpu()
            assert torch.equal(got, want), (got, want)
    assert engine.strategy.gathers.live_numel == 0
    engine.destroy()


def test_cuda_two_stage3_offload_engines_side_by_side() -> None:
    import shardwise
    from shardwise.zero import GatheredParameters
    torch.backends.cuda.matmul.allow_tf32 = False
    specs = [(0, 1e-2, 1), (3, 3e-2, 5)]
    engines = []
    for seed, lr, _ in specs:
        cfg = engine_config(3, 2, 2, 0.0, lr, zero_optimization={
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 300,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True}})
        engines.append(shardwise.initialize(model=make_model(seed), config=cfg)[0])
    data = [global_batches(3, 4, seed=ds) for _, _, ds in specs]
    for step in range(3):
        for k in range(2):
            losses = [e(*(t[k * 2:(k + 1) * 2].cuda() for t in d[step]))
                      for e, d in zip(engines, data)]
            for e, loss in zip(engines, losses):
                e.backward(loss)
            for e in engines:
                e.step()
    for engine, (seed, lr, ds) in zip(engines, specs):
        model = make_model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        for x, y in global_batches(3, 4, seed=ds):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        with GatheredParameters(list(engine.module.parameters())):
            got = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        bad = max_rel_diff(got, {n: p.detach() for n, p in model.named_parameters()})
        assert not bad, (seed, bad)
        engine.destroy()
