"""wall_clock_breakdown with offload on a GPU: the side-stream copies are timed by CUDA event
pairs, read when the step's times are taken (issue 24)."""
from __future__ import annotations

import re

import pytest
import torch

from tests.monitor_utils import initialize, monitor_config, read_csv, train

pytestmark = pytest.mark.gpu

NUM = r"\d+\.\d\d"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zero", [
    {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    {"stage": 3, "stage3_param_persistence_threshold": 0,
     "offload_param": {"device": "cpu", "pin_memory": True},
     "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    {"stage": 3, "stage3_param_persistence_threshold": 0,
     "offload_optimizer": {"device": "cpu", "pin_memory": True}},
], ids=["zero2", "zero3-param-opt", "zero3-opt"])
def test_offload_copy_times_on_gpu(tmp_path, capsys, zero) -> None:
    cfg = monitor_config(tmp_path, bf16={"enabled": True}, wall_clock_breakdown=True,
                         zero_optimization=zero,
                         csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                      "job_name": "gpu"})
    engine = initialize(cfg)
    train(engine, steps=4)
    engine.destroy()
    out = capsys.readouterr().out
    lines = re.findall(rf"\| step: {NUM} \| offload_d2h: ({NUM}) \| offload_h2d: ({NUM})\n", out)
    assert len(lines) == 2, out
    assert all(float(d) > 0 and float(h) > 0 for d, h in lines), lines
    for name in ("offload_d2h", "offload_h2d"):
        _, rows = read_csv(tmp_path / "gpu" / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert len(rows) == 4 and all(v > 0 for _, v in rows), (name, rows)
