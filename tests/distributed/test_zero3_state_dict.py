"""``engine.module.state_dict()`` under ZeRO stage 3 at world size 2 without
``stage3_gather_16bit_weights_on_model_save``: refused with a ZeroError outside a gather, and
the full weights inside ``GatheredParameters`` (the context the error recommends; issue 18,
bug 3)."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.distributed._hf_tiny import batches, build


def _state_dicts(rank: int, world: int) -> dict:
    import shardwise
    from shardwise.errors import ZeroError
    from shardwise.zero import GatheredParameters
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}
    engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    ids = batches(1, 2)[0]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    try:
        engine.module.state_dict()
        refused = False
    except ZeroError:
        refused = True
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        inside = {k: v.clone() for k, v in engine.module.state_dict().items()}
    released = all(p.numel() == 0 for p in engine.module.parameters() if p.dim() > 1)
    engine.destroy()
    return {"refused": refused, "params": params, "sd": inside, "released": released}


def test_state_dict_inside_gathered_parameters_world_2() -> None:
    reference = build("llama").state_dict()
    for rank, got in enumerate(run_distributed(_state_dicts, 2)):
        assert got["refused"], f"rank {rank}: state_dict() outside a gather must raise"
        assert got["sd"].keys() == reference.keys()
        for k, v in got["sd"].items():
            assert v.shape == reference[k].shape, k
            if k in got["params"]:
                assert torch.equal(v, got["params"][k]), k
        assert got["released"], f"rank {rank}: parameters left gathered after the context"
