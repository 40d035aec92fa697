"""wall_clock_breakdown with offload (issue 24): the offload copy times in DeepSpeed-style log
lines (after DeepSpeed's fields) and as ``Train/Samples/elapsed_time_ms_offload_*`` events;
nothing extra without offload, and no timer at all without the breakdown."""
from __future__ import annotations

import re

import pytest

from shardwise.monitor.copy_timers import D2H, H2D, OffloadCopyTimer
from tests.monitor_utils import initialize, monitor_config, read_csv, train

NUM = r"\d+\.\d\d"
DS_STEP_LINE = (rf"\[Rank 0\] time \(ms\) \| fwd: {NUM} \| bwd: {NUM} \| bwd_inner: {NUM} \| "
                rf"bwd_allreduce: {NUM} \| step: {NUM}")
DS_MICRO_LINE = (rf"\[Rank 0\] time \(ms\) \| fwd_microstep: {NUM} \| bwd_microstep: {NUM} \| "
                 rf"bwd_inner_microstep: {NUM} \| bwd_allreduce_microstep: {NUM} \| "
                 rf"step_microstep: {NUM}")

ZERO2_OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
ZERO3_OFFLOAD = {"stage": 3, "stage3_param_persistence_threshold": 0,
                 "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}


def _offload_fields(out: str):
    lines = re.findall(DS_STEP_LINE + rf" \| offload_d2h: ({NUM}) \| offload_h2d: ({NUM})\n", out)
    return [(float(d2h), float(h2d)) for d2h, h2d in lines]


@pytest.mark.parametrize("zero", [ZERO2_OFFLOAD, ZERO3_OFFLOAD], ids=["zero2", "zero3"])
def test_offload_copy_times_in_log_lines_and_csv(tmp_path, capsys, zero) -> None:
    cfg = monitor_config(tmp_path, wall_clock_breakdown=True, zero_optimization=zero,
                         csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                      "job_name": "run"})
    engine = initialize(cfg)
    assert isinstance(engine.timers.copies, OffloadCopyTimer)
    train(engine, steps=4)
    engine.destroy()
    out = capsys.readouterr().out
    fields = _offload_fields(out)
    assert len(fields) == 2, out  # steps_per_print 2 over 4 steps
    assert all(d2h > 0 and h2d > 0 for d2h, h2d in fields), fields
    # DeepSpeed's micro-step line is unchanged
    assert len(re.findall(DS_MICRO_LINE + "\n", out)) == 2, out
    samples = [4 * k for k in range(1, 5)]  # x = global samples (micro 2 x GA 2)
    for name in (D2H, H2D):
        header, rows = read_csv(tmp_path / "run" / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert header == ["step", f"elapsed_time_ms_{name}"]
        assert [s for s, _ in rows] == samples and all(v > 0 for _, v in rows), rows


def test_without_offload_the_lines_are_exactly_deepspeeds(tmp_path, capsys) -> None:
    cfg = monitor_config(tmp_path, wall_clock_breakdown=True, zero_optimization={"stage": 2},
                         csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                      "job_name": "run"})
    engine = initialize(cfg)
    assert engine.timers.copies is None
    train(engine, steps=2)
    engine.destroy()
    out = capsys.readouterr().out
    assert re.search(DS_MICRO_LINE + "\n" + DS_STEP_LINE + "\n", out), out
    assert "offload" not in out
    assert not list((tmp_path / "run").glob("*offload*"))


@pytest.mark.parametrize("zero", [ZERO2_OFFLOAD, ZERO3_OFFLOAD], ids=["zero2", "zero3"])
def test_no_copy_timer_without_the_breakdown(tmp_path, capsys, zero, monkeypatch) -> None:
    engine = initialize(monitor_config(tmp_path, zero_optimization=zero))
    assert engine.timers.copies is None
    strategy = engine.strategy
    timers = ([strategy.pipeline.copy_timer] if zero["stage"] == 2 else
              [strategy._acc.copy_timer, strategy.gathers.copy_timer, strategy._copy_timer])
    assert timers == [None] * len(timers)
    spans = []
    monkeypatch.setattr(OffloadCopyTimer, "span", lambda *a: spans.append(a))
    train(engine, steps=2)
    assert spans == [] and "time (ms)" not in capsys.readouterr().out
