"""Monitors at world size 2 (gloo): only global rank 0 writes, its rows are the losses rank 0's
loop saw, x counts the global samples of both ranks, tokens/s counts both ranks."""
from __future__ import annotations

import math
from pathlib import Path

from tests.dist_utils import run_distributed


def _train(rank: int, world_size: int, out: str):
    from tests.monitor_utils import initialize, monitor_config, train
    cfg = monitor_config(Path(out), zero_optimization={"stage": 2},
                         csv_monitor={"enabled": True, "output_path": out, "job_name": f"r{rank}"})
    engine = initialize(cfg)
    losses = train(engine, steps=2)
    engine.destroy()
    return losses, len(engine.monitor.writers)


def test_only_rank_0_writes_and_x_is_global_samples(tmp_path) -> None:
    from tests.monitor_utils import SEQ, read_csv
    results = run_distributed(_train, 2, str(tmp_path))
    (losses0, writers0), (_, writers1) = results
    assert (writers0, writers1) == (1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0"]
    _, rows = read_csv(tmp_path / "r0" / "Train_Samples_train_loss.csv")
    # micro 2 x GA 2 x 2 ranks = 8 samples per step; values: rank 0's window means
    assert [s for s, _ in rows] == [8, 16]
    want = [(losses0[0] + losses0[1]) / 2, (losses0[2] + losses0[3]) / 2]
    assert all(math.isclose(v, w, rel_tol=1e-6) for (_, v), w in zip(rows, want))
    _, sps = read_csv(tmp_path / "r0" / "Train_Samples_samples_per_sec.csv")
    _, tps = read_csv(tmp_path / "r0" / "Train_Samples_tokens_per_sec.csv")
    assert math.isclose(tps[0][1], sps[0][1] * SEQ, rel_tol=1e-9)  # both ranks' tokens
