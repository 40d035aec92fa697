"""``shardwise --autotuning tune|run`` end to end on CPU: real trials through the launcher.

One tune (micro batch {1, 2, 4} x stage {0, 1}; the script raises for micro batch 4) is shared
by the tests: 4 trial launches, then one resume launch and one ``run``. Slow on a loaded
2-core machine because every trial is a real launcher + worker process.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "autotuning_assets" / "tiny_train.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": [0, 1]},
    "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2,
                   "max_train_micro_batch_size_per_gpu": 4, "num_tuning_micro_batch_sizes": 1,
                   "trial_timeout": 300},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _autotune(folder: Path, mode: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shardwise", "--autotuning", mode, "--master_port", str(_free_port()),
           str(SCRIPT), "--deepspeed", "--deepspeed_config", "ds.json"]
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TINY_CRASH_MBS": "4", **env})


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune")
    (folder / "ds.json").write_text(json.dumps(CONFIG))
    proc = _autotune(folder, "tune")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder, proc.stdout


def test_tune_writes_deepspeeds_result_files(tuned):
    folder, out = tuned
    exps = folder / "autotuning_exps"
    assert sorted(p.name for p in exps.iterdir()) == ["z0_tmbspg2_gas1", "z0_tmbspg4_gas1",
                                                     "z1_tmbspg2_gas1", "z1_tmbspg4_gas1"]
    for name in ("z0_tmbspg2_gas1", "z1_tmbspg2_gas1"):
        for f in ("cmd.txt", "ds_config.json", "metrics.json", "stdout.log", "stderr.log"):
            assert (exps / name / f).is_file(), (name, f)
        metrics = json.loads((exps / name / "metrics.json").read_text())
        assert metrics["throughput"] > 0 and metrics["train_micro_batch_size_per_gpu"] == 2
    results = folder / "autotuning_results"
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    assert optimal["train_micro_batch_size_per_gpu"] == 2 and optimal["zero_optimization"]["stage"] in (0, 1)
    cmd = (results / "cmd_optimal.txt").read_text()
    assert "ds_config_optimal.json" in cmd and "--autotuning" not in cmd and str(SCRIPT) in cmd
    summary = (results / "summary.txt").read_text()
    for name in ("z0_tmbspg2_gas1", "z0_tmbspg4_gas1", "z1_tmbspg2_gas1", "z1_tmbspg4_gas1"):
        assert name in summary
    assert "trial 1/" in out and "best:" in out and "left" in out


def test_crashing_experiment_is_recorded_and_skipped(tuned):
    folder, _ = tuned
    result = json.loads((folder / "autotuning_exps" / "z0_tmbspg4_gas1" / "result.json").read_text())
    assert result["status"] == "error" and "refusing micro batch 4" in result["error"]
    assert not (folder / "autotuning_exps" / "z0_tmbspg4_gas1" / "metrics.json").exists()
    summary = (folder / "autotuning_results" / "summary.txt").read_text()
    assert "refusing micro batch 4" in summary


def test_optimal_config_loads_in_initialize(tuned):
    folder, _ = tuned
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    path = folder / "autotuning_results" / "ds_config_optimal.json"
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=str(path))
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.zero_optimization_stage() == json.loads(path.read_text())["zero_optimization"]["stage"]


def test_interrupted_tune_resumes(tuned, tmp_path):
    folder, _ = tuned
    shutil.copytree(folder / "autotuning_exps", tmp_path / "autotuning_exps")
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    shutil.rmtree(tmp_path / "autotuning_exps" / "z1_tmbspg2_gas1")  # killed before it finished
    before = {p.name: (p / "result.json").stat().st_mtime_ns for p in (tmp_path / "autotuning_exps").iterdir()}
    proc = _autotune(tmp_path, "tune")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(reused)") == 3
    after = {p.name: (p / "result.json").stat().st_mtime_ns for p in (tmp_path / "autotuning_exps").iterdir()}
    assert all(after[name] == stamp for name, stamp in before.items())  # not rerun
    assert (tmp_path / "autotuning_exps" / "z1_tmbspg2_gas1" / "metrics.json").is_file()  # rerun


def test_run_trains_with_the_best_config(tuned, tmp_path):
    folder, _ = tuned
    done = tmp_path / "done.txt"
    proc = _autotune(folder, "run", TINY_DONE_FILE=str(done))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(reused)") == 4  # the finished tune is read back, not rerun
    steps, micro, stage = map(int, done.read_text().split())
    optimal = json.loads((folder / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert steps == 6 and micro == 2 and stage == optimal["zero_optimization"]["stage"]
