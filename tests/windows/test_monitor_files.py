"""The CSV monitor's files and ``shardwise plot``'s reader on the platform the tests run on
(Windows under the Windows job): DeepSpeed's file names, header, rows, and an appended run."""
from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config.monitor import CSVConfig
from shardwise.monitor import CSVWriter, MonitorMaster
from shardwise.monitor.run_reader import read_run

pytestmark = pytest.mark.windows


def test_csv_monitor_files_in_a_folder_with_spaces(tmp_path: Path) -> None:
    root = tmp_path / "my runs"
    for _ in range(2):  # a resumed run appends: one header only
        monitor = MonitorMaster([CSVWriter(CSVConfig(enabled=True, output_path=str(root),
                                                     job_name="job 1"))], enabled=True)
        monitor.write_events([("Train/Samples/train_loss", 2.5, 8), ("Eval/my loss", 1.0, 8)])
        monitor.close()
    job = root / "job 1"
    assert sorted(p.name for p in job.iterdir()) == ["Eval_my_loss.csv",
                                                     "Train_Samples_train_loss.csv"]
    text = (job / "Train_Samples_train_loss.csv").read_text()
    assert text.splitlines() == ["step,train_loss", "8,2.5", "8,2.5"]
    folder, run = read_run(root)
    assert folder == job and run["Eval_my_loss"] == [(8, 1.0), (8, 1.0)]
