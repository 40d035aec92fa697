"""ZeRO-1/2 at world size 2 on Windows, with the process group made by the library itself.

tests/distributed/test_zero_parity.py (also in the Windows subset) checks every stage inside
a process group that the test harness creates. Here the two spawned ranks get only the
launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; USE_LIBUV unset) and
``shardwise.initialize`` must create the group: on Windows that means choosing gloo and a
TCPStore without libuv. Both stages must then match single-process torch AdamW, and a
checkpoint saved on Windows must have Windows-valid names and resume bit-exactly. One spawn
runs everything (each rank pays 6-10 s for ``import torch`` under Wine).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.windows._helpers import ON_WINDOWS, spawn_ranks

pytestmark = pytest.mark.windows

STEPS, MICRO, GA, LR, CLIP = 6, 2, 2, 1e-2, 0.05


def _ranks(rank: int, world: int, ckpt_root: str) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import shardwise
    from tests.distributed._parity import engine_config, global_batches, make_model, train_engine

    out: Dict[str, Any] = {"libuv_before": os.environ.get("USE_LIBUV")}
    out["stage1"] = train_engine(rank, world, engine_config(1, MICRO, GA, CLIP, LR), STEPS)
    out["backend"] = dist.get_backend()
    out["libuv_after"] = os.environ.get("USE_LIBUV")
    out["stage2"] = train_engine(rank, world, engine_config(2, MICRO, GA, CLIP, LR), STEPS)

    # Checkpoint on Windows paths: save after 3 steps, train 3 more; reload and train the same 3.
    cfg = engine_config(2, MICRO, 1, CLIP, LR)
    batches = global_batches(6, MICRO * world, seed=5)

    def run(engine, some):
        losses = []
        for x, y in some:
            lo = rank * MICRO
            loss = engine(x[lo:lo + MICRO], y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    run(engine, batches[:3])
    engine.save_checkpoint(ckpt_root)  # default tag: global_step3
    tail = run(engine, batches[3:])
    fresh, *_ = shardwise.initialize(model=make_model(seed=7), config=cfg)
    path, _ = fresh.load_checkpoint(ckpt_root)
    resumed = run(fresh, batches[3:])
    dist.barrier()
    out["checkpoint"] = {
        "path": str(path), "tail": tail, "resumed": resumed,
        "names": sorted(str(p.relative_to(ckpt_root)) for p in Path(ckpt_root).rglob("*")),
        "params_equal": all(torch.equal(a, b) for a, b in
                            zip(engine.module.state_dict().values(), fresh.module.state_dict().values())),
    }
    return out


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory):
    from shardwise import initialize  # noqa: F401 - a rename must fail, not skip
    import tests.distributed._parity  # noqa: F401  (a rename must fail, not skip)
    ckpt = tmp_path_factory.mktemp("zero windows ckpt")  # a space, as in Windows user folders
    return spawn_ranks(_ranks, 2, str(ckpt)), ckpt


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stage_matches_torch_at_world_size_2(zero_results, stage: int) -> None:
    from tests.distributed._parity import max_rel_diff, reference_params
    per_rank, _ = zero_results
    ref = reference_params(STEPS, MICRO * GA * 2, LR, CLIP)
    for rank, res in enumerate(per_rank):
        bad = max_rel_diff(res[f"stage{stage}"], ref)
        assert not bad, f"stage {stage} rank {rank}: {bad}"


def test_library_made_a_gloo_group_without_libuv(zero_results) -> None:
    per_rank, _ = zero_results
    for res in per_rank:
        assert res["backend"] == "gloo"
        assert res["libuv_before"] is None  # the test gave the ranks no USE_LIBUV
        if ON_WINDOWS:
            assert res["libuv_after"] == "0", res  # set by shardwise before creating the store


def test_checkpoint_on_windows_paths_resumes_exactly(zero_results) -> None:
    per_rank, ckpt = zero_results
    ck = per_rank[0]["checkpoint"]
    assert ck["resumed"] == ck["tail"]  # bit-exact losses after resume
    assert ck["params_equal"]
    names = ck["names"]
    assert "latest" in names
    assert (ckpt / "latest").read_text().strip() == "global_step3"
    assert any(n.startswith("global_step3") for n in names)
    for name in names:
        assert not set(name) & set(':*?"<>|'), name
    assert not any(".tmp-" in n for n in names), names
    if ON_WINDOWS and ck["path"] not in (None, "None"):
        assert ck["path"][1:3] == ":\\", ck["path"]  # a drive-letter path came back
