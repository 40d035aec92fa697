"""W&B and Comet monitors in their offline modes (no network): the runs' local files hold
DeepSpeed's tags."""
from __future__ import annotations

import json
import time
import zipfile

import pytest

from tests.monitor_utils import initialize, monitor_config, train


def test_wandb_offline_run_writes_its_local_files(tmp_path, monkeypatch) -> None:
    import wandb  # a test dependency: missing fails
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    engine = initialize(monitor_config(tmp_path, wandb={"enabled": True, "project": "sw",
                                                        "group": "unit"}))
    train(engine, steps=2)
    engine.destroy()  # flush and finish the run
    wandb.teardown()  # stop wandb's service process, which writes the run file
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    deadline = time.monotonic() + 30  # the wandb service process writes the file after finish()
    while b"Train/Samples/lr" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = runs[0].read_bytes()
    for tag in (b"Train/Samples/train_loss", b"Train/Samples/lr", b"Train/Samples/global_grad_norm"):
        assert tag in data


def test_comet_offline_experiment_writes_its_archive(tmp_path, monkeypatch) -> None:
    import comet_ml  # noqa: F401  (a test dependency: missing fails)
    offline = tmp_path / "comet"
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(offline))
    for flag in ("COMET_AUTO_LOG_ENV_DETAILS", "COMET_AUTO_LOG_GIT_METADATA",
                 "COMET_AUTO_LOG_CODE", "COMET_AUTO_LOG_ENV_HOST", "COMET_AUTO_LOG_DEPENDENCIES",
                 "COMET_AUTO_LOG_CLI_ARGUMENTS", "COMET_AUTO_LOG_GIT_PATCH"):
        monkeypatch.setenv(flag, "false")
    engine = initialize(monitor_config(tmp_path, comet={
        "enabled": True, "online": False, "project": "sw", "experiment_name": "unit",
        "samples_log_interval": 8}))
    train(engine, steps=4)  # samples 4, 8, 12, 16: logged at 4 and 12 (interval 8)
    engine.destroy()
    archives = list(offline.glob("*.zip"))
    assert len(archives) == 1, list(tmp_path.rglob("*"))
    with zipfile.ZipFile(archives[0]) as z:
        lines = z.read("messages.json").decode().splitlines()
    metrics = [json.loads(line)["payload"]["metric"] for line in lines
               if json.loads(line)["type"] == "metric_msg"]
    steps = {}
    for m in metrics:
        steps.setdefault(m["metricName"], []).append(m["step"])
    assert steps["Train/Samples/train_loss"] == [4, 12] and steps["Train/Samples/lr"] == [4, 12]


def test_comet_online_without_api_key_is_a_config_error(tmp_path, monkeypatch) -> None:
    import comet_ml  # noqa: F401  (a test dependency: missing fails)
    from shardwise.config import load_config
    from shardwise.errors import ConfigError
    from shardwise.monitor import MonitorMaster
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.setenv("COMET_CONFIG", str(tmp_path / "none.config"))  # no ~/.comet.config key
    with pytest.raises(ConfigError, match="COMET_API_KEY.*\"online\": false"):
        MonitorMaster.from_config(load_config(monitor_config(
            tmp_path, comet={"enabled": True, "project": "sw"})), rank=0)
