"""Monitors (issue 24): DeepSpeed's CSV and TensorBoard layout, tags and values, buffering,
rank 0 only, ``write_events``, missing packages, and the wall_clock_breakdown log lines."""
from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.monitor import MonitorMaster, csv_file_name
from shardwise.monitor.throughput import FlopsModel
from tests.monitor_utils import SEQ, VOCAB, initialize, monitor_config, read_csv, train

DS_TAGS = ["Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/global_grad_norm"]


def _window_means(losses, ga):
    return [sum(losses[i:i + ga]) / ga for i in range(0, len(losses), ga)]


def test_csv_monitor_files_rows_and_values_match_the_loop(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDWISE_PEAK_TFLOPS", "0.001")  # a CPU has no known peak: name one
    cfg = monitor_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                                "job_name": "run1"})
    engine = initialize(cfg)
    n_params = sum(p.numel() for p in engine.module.parameters())
    # 6N + 12 L h s with N = parameters minus the (untied) input embedding table
    assert engine.step_logger.flops == FlopsModel(n_params - VOCAB * 32, layers=2, hidden=32)
    losses = train(engine, steps=5)
    job = tmp_path / "run1"
    # flushed at steps_per_print (2, 4): step 5 is still buffered
    assert len(read_csv(job / "Train_Samples_train_loss.csv")[1]) == 4
    lrs = [engine.get_lr()[0]]
    engine.destroy()  # flushes the rest (as exit does)
    header, rows = read_csv(job / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    samples = [4 * k for k in range(1, 6)]  # x = global samples (micro 2 x GA 2)
    assert [s for s, _ in rows] == samples
    expected = _window_means(losses, 2)
    assert all(math.isclose(v, e, rel_tol=1e-6) for (_, v), e in zip(rows, expected)), (rows, expected)
    header, lr_rows = read_csv(job / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [s for s, _ in lr_rows] == samples
    assert math.isclose(lr_rows[-1][1], lrs[0], rel_tol=1e-9)
    assert lr_rows[0][1] < lr_rows[-1][1]  # WarmupLR: the lr after every step, not a constant
    _, norms = read_csv(job / "Train_Samples_global_grad_norm.csv")
    assert len(norms) == 5 and all(v > 0 for _, v in norms)
    # ours, at the log steps (2 and 4): throughput and host memory; tokens/s = samples/s x seq
    _, sps = read_csv(job / "Train_Samples_samples_per_sec.csv")
    _, tps = read_csv(job / "Train_Samples_tokens_per_sec.csv")
    assert [s for s, _ in sps] == [8, 16] and [s for s, _ in tps] == [8, 16]
    assert all(math.isclose(t, s * SEQ, rel_tol=1e-9) for (_, s), (_, t) in zip(sps, tps))
    _, mfu = read_csv(job / "Train_Samples_mfu.csv")
    per_token = engine.step_logger.flops.per_token(SEQ)
    assert all(math.isclose(m, per_token * t / 1e9, rel_tol=1e-9) for (_, m), (_, t) in zip(mfu, tps))
    assert read_csv(job / "Train_Samples_host_rss_gib.csv")[1][0][1] > 0
    # no fp16 -> no loss scale; no wall_clock_breakdown -> no phase times
    assert not (job / "Train_Samples_loss_scale.csv").exists()
    assert not list(job.glob("*elapsed_time*"))


def test_tensorboard_tags_steps_and_values(tmp_path) -> None:
    import tensorboard  # noqa: F401  (a test dependency: missing fails)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = monitor_config(tmp_path, fp16={"enabled": True, "initial_scale_power": 8},
                         wall_clock_breakdown=True,
                         tensorboard={"enabled": True, "output_path": str(tmp_path),
                                      "job_name": "tb"})
    engine = initialize(cfg)
    losses = train(engine, steps=4)
    engine.destroy()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    phases = ["forward", "backward", "backward_inner", "backward_allreduce", "step"]
    expected_tags = DS_TAGS + ["Train/Samples/loss_scale"] + [
        f"Train/Samples/elapsed_time_ms_{p}" for p in phases]
    assert set(expected_tags) <= tags, tags
    loss_events = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss_events] == [4, 8, 12, 16]
    # fp16: the loop saw fp16 losses; the monitor averages them in fp32 like DeepSpeed
    for e, want in zip(loss_events, _window_means(losses, 2)):
        assert math.isclose(e.value, want, rel_tol=1e-3)
    assert [e.value for e in acc.Scalars("Train/Samples/loss_scale")][0] == 2.0 ** 8
    assert all(e.value > 0 for e in acc.Scalars("Train/Samples/elapsed_time_ms_forward"))


def test_write_events_user_tags_do_not_collide_and_rank_1_writes_nothing(tmp_path) -> None:
    cfg = monitor_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                                "job_name": "j"})
    engine = initialize(cfg)
    assert engine.monitor.enabled
    engine.monitor.write_events([("Eval/my metric", 0.5, 3), ("Eval/my metric", torch.tensor(0.25), 7)])
    train(engine, steps=1)
    engine.destroy()
    header, rows = read_csv(tmp_path / "j" / csv_file_name("Eval/my metric"))
    assert csv_file_name("Eval/my metric") == "Eval_my_metric.csv"
    assert header == ["step", "my metric"] and rows == [(3, 0.5), (7, 0.25)]
    assert len(read_csv(tmp_path / "j" / "Train_Samples_train_loss.csv")[1]) == 1
    with pytest.raises(TypeError, match="tag: str, value"):
        engine.monitor.write_events([(1.0, "tag", 3)])
    other = MonitorMaster.from_config(load_config(dict(cfg, csv_monitor={
        "enabled": True, "output_path": str(tmp_path), "job_name": "rank1"})), rank=1)
    other.write_events([("a/b", 1.0, 1)])
    other.close()
    assert other.enabled and not other.writers and not (tmp_path / "rank1").exists()


def test_no_monitor_section_means_no_files_and_no_events(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    engine = initialize(monitor_config(tmp_path))
    assert not engine.monitor.enabled
    engine.monitor.write_events([("x/y", 1.0, 1)])
    train(engine, steps=2)
    engine.destroy()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("section,module,pip", [("tensorboard", "tensorboard", "tensorboard"),
                                                ("wandb", "wandb", "wandb"),
                                                ("comet", "comet_ml", "comet_ml>=3.41.0")])
def test_missing_package_is_a_config_error_at_initialize(tmp_path, monkeypatch, section, module,
                                                         pip) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    cfg = monitor_config(tmp_path, **{section: {"enabled": True}})
    with pytest.raises(ConfigError, match=re.escape(f'pip install "{pip}"')):
        initialize(cfg)


def test_wall_clock_breakdown_prints_deepspeeds_lines(tmp_path, capsys) -> None:
    engine = initialize(monitor_config(tmp_path, wall_clock_breakdown=True))
    train(engine, steps=2)
    out = capsys.readouterr().out
    num = r"\d+\.\d\d"
    micro = (rf"\[Rank 0\] time \(ms\) \| fwd_microstep: {num} \| bwd_microstep: {num} \| "
             rf"bwd_inner_microstep: {num} \| bwd_allreduce_microstep: {num} \| "
             rf"step_microstep: {num}\n")
    whole = (rf"\[Rank 0\] time \(ms\) \| fwd: {num} \| bwd: {num} \| bwd_inner: {num} \| "
             rf"bwd_allreduce: {num} \| step: {num}\n")
    assert re.search(micro + whole, out), out
    values = dict(re.findall(r"\| (\w+): (\d+\.\d\d)", out.splitlines()[-1]))
    assert float(values["fwd"]) > 0 and float(values["bwd"]) >= float(values["bwd_inner"])


def test_timers_are_free_when_wall_clock_breakdown_is_off(tmp_path, capsys, monkeypatch) -> None:
    engine = initialize(monitor_config(tmp_path))
    calls = []
    monkeypatch.setattr(engine.timers, "_sync", lambda: calls.append(1))
    train(engine, steps=2)
    assert calls == [] and "time (ms)" not in capsys.readouterr().out


def test_monitor_sections_have_deepspeeds_keys_and_defaults() -> None:
    cfg = load_config({"train_batch_size": 1, "wandb": {"enabled": True, "team": "t", "group": "g"},
                       "comet": {"enabled": False, "samples_log_interval": 10, "online": False},
                       "tensorboard": None})
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == \
        (False, "", "DeepSpeedJobName")
    assert (cfg.wandb.project, cfg.wandb.team, cfg.wandb.group) == ("deepspeed", "t", "g")
    assert cfg.csv_monitor.job_name == "DeepSpeedJobName"
    assert cfg.comet.samples_log_interval == 10 and cfg.comet.online is False
    assert not any("wandb" in w for w in cfg.warnings)  # no longer an ignored section
    # a misspelt key of a monitor section is an error naming both keys (the typo rule)
    with pytest.raises(ConfigError, match=r"csv_monitor\.jobname.*csv_monitor\.job_name"):
        load_config({"train_batch_size": 1, "csv_monitor": {"enabled": True, "jobname": "x"}})
