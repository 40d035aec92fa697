"""Stage 3 with ``offload_param: {device: "nvme"}`` on a CUDA device: the shards are read
from swap files into the pinned read buffers, copied to the device on the gather context's
side stream (the buffer goes back to the pool after an event on that stream), and written
back after each step. A few training steps must give exactly the parameters of the same run
with ``offload_param: {device: "cpu"}`` (same compute, only the shards' home differs), in
bf16, with a buffer pool smaller than one layer's parameters (buffers recycled mid-batch)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed._hf_tiny import batches, build

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS, MICRO, GA = 4, 2, 2


def _config(offload_param: dict, prefetch: int, clip: float) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
            "steps_per_print": 0, "bf16": {"enabled": True}, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40,
                                  "stage3_prefetch_bucket_size": prefetch,
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": offload_param}}


def _train(kind: str, offload_param: dict, prefetch: int, clip: float):
    import shardwise
    from shardwise.zero import GatheredParameters
    engine, *_ = shardwise.initialize(model=build(kind),
                                      config=_config(offload_param, prefetch, clip))
    for ids in batches(STEPS, MICRO * GA):
        for k in range(GA):
            mine = ids[k * MICRO:(k + 1) * MICRO].cuda()
            engine.backward(engine(input_ids=mine, labels=mine).loss)
            engine.step()
    torch.cuda.synchronize()
    with GatheredParameters(list(engine.module.parameters())):
        out = {k: v.detach().float().cpu() for k, v in engine.module.named_parameters()}
    swapper = engine.strategy.params.swapper
    stats = dict(swapper.stats) if swapper is not None else None
    engine.destroy()
    return out, stats


# no clipping: the eager CPU step writes shards back from its worker thread during backward;
# clipping: every shard is written after the step
@pytest.mark.parametrize("prefetch, clip", [(3000, 0.0), (50_000_000, 1.0)],
                         ids=["small-bucket-eager", "default-bucket-clip"])
@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
def test_cuda_nvme_params_equal_cpu_offload(kind: str, prefetch: int, clip: float,
                                            tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    want, _ = _train(kind, {"device": "cpu", "pin_memory": True}, prefetch, clip)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "max_in_cpu": 0,
            "min_nvme_bytes": 0, "buffer_count": 3}
    got, stats = _train(kind, nvme, prefetch, clip)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, [(k, (got[k] - want[k]).abs().max().item()) for k in bad]
    assert stats["read_ahead_used"] > 0 and stats["writes"] > 0, stats
    assert not list(tmp_path.rglob("*.swp")), "destroy() removes the swap files"
