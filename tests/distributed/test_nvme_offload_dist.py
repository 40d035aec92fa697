"""NVMe optimizer offload at world size 2 (gloo, spawn) on tiny Hugging Face LMs (Llama, Mistral/GQA): stages 1, 2
and 3 with the optimizer states in per-rank swap files give the parameters of single-process
torch AdamW (tests/unit/test_nvme_optimizer.py covers world size 1 and the rest)."""
from __future__ import annotations

import os
import tempfile
from typing import Dict


from tests.dist_utils import run_distributed
from tests.distributed._hf_tiny import batches, build, mismatches, reference

STEPS, MICRO, GA, LR = 4, 2, 2, 1e-2
CASES = [("llama", 1), ("gqa", 2), ("llama", 3)]  # gqa: Mistral, grouped-query attention


def _train(rank: int, world: int, kind: str, stage: int, root: str) -> Dict[str, object]:
    import shardwise
    from shardwise.zero import GatheredParameters
    zero = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": 3000,
            "stage3_param_persistence_threshold": 64,
            "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 3}}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
           "steps_per_print": 0, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    engine, *_ = shardwise.initialize(model=build(kind), config=cfg)
    for ids in batches(STEPS, MICRO * GA * world):
        for k in range(GA):
            lo = (k * world + rank) * MICRO
            engine.backward(engine(input_ids=ids[lo:lo + MICRO], labels=ids[lo:lo + MICRO]).loss)
            engine.step()
    mine = [f for f in os.listdir(os.path.join(root, "shardwise_swap")) if f.endswith(f"rank{rank:05d}")]
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"params": params, "folders": mine,
            "left": [f for f in mine if os.path.exists(os.path.join(root, "shardwise_swap", f))]}


def _all(rank: int, world: int, root: str) -> Dict[object, object]:
    return {case: _train(rank, world, case[0], case[1], os.path.join(root, f"{case[0]}{case[1]}"))
            for case in CASES}


def test_nvme_offload_world2_matches_torch_on_tiny_lms() -> None:
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_distributed(_all, 2, root)
    for kind, stage in CASES:
        ref = reference(kind, STEPS, MICRO * GA * 2, LR)
        for rank, results in enumerate(per_rank):
            got = results[(kind, stage)]
            bad = mismatches(got["params"], ref)
            assert not bad, f"{kind} stage {stage} rank {rank}: {bad}"
            assert len(got["folders"]) == 1, got["folders"]  # one swap folder per rank and run
            assert not got["left"], got["left"]  # removed by destroy()
