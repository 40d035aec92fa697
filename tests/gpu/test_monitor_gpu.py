"""Monitors on a GPU: the peak-memory and MFU events, wall-clock phase times from synchronised
timers, and the same per-step losses as the loop saw."""
from __future__ import annotations

import math

import pytest
import torch

from tests.monitor_utils import initialize, monitor_config, read_csv, train

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_monitor_events_on_gpu(tmp_path, capsys) -> None:
    cfg = monitor_config(tmp_path, bf16={"enabled": True}, wall_clock_breakdown=True,
                         zero_optimization={"stage": 2},
                         csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                      "job_name": "gpu"})
    engine = initialize(cfg)
    losses = train(engine, steps=4)
    engine.destroy()
    job = tmp_path / "gpu"
    _, rows = read_csv(job / "Train_Samples_train_loss.csv")
    want = [(losses[i] + losses[i + 1]) / 2 for i in range(0, 8, 2)]
    assert all(math.isclose(v, w, rel_tol=1e-6) for (_, v), w in zip(rows, want))
    _, mem = read_csv(job / "Train_Samples_gpu_peak_memory_gib.csv")
    assert len(mem) == 2 and all(v > 0 for _, v in mem)
    if engine.step_logger.peak is not None:  # a GPU in the peak table (H100/H200, A100, ...)
        _, mfu = read_csv(job / "Train_Samples_mfu.csv")
        assert all(0 < v < 1 for _, v in mfu)
    _, fwd = read_csv(job / "Train_Samples_elapsed_time_ms_forward.csv")
    assert len(fwd) == 4 and all(v > 0 for _, v in fwd)
    out = capsys.readouterr().out
    assert "[Rank 0] time (ms) | fwd: " in out and "| bwd_allreduce: " in out
