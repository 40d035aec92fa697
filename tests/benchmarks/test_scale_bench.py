"""benchmarks/scale_bench.py end to end on a tiny model on CPU: a zero.Init + ZeRO-3 offload
trial trains and reports its arithmetic, and the host-memory watchdog stops a trial."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--hidden", "32", "--intermediate", "64", "--heads", "2",
        "--kv-heads", "1", "--vocab", "128", "--seq", "16", "--micro-batch", "2"]


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_bench.py"), *TINY,
                           "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())["results"]


def test_tiny_trials_train_and_report_model_state_bytes(tmp_path: Path) -> None:
    proc, rows = _run(tmp_path, "--sw-layers", "1,2")
    assert [r["layers"] for r in rows] == [1, 2]
    for row in rows:
        assert "error" not in row, row
        assert row["states16_gib"] * 18 == row["states18_gib"] * 16
        assert len(row["losses"]) == 3 and row["step_s"] > 0
    assert rows[1]["n_params"] > rows[0]["n_params"]
    assert "largest that trained, sw" in proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_nvme_trials_train_and_the_host_cap_stops_a_trial(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    proc, rows = _run(tmp_path, "--sw-layers", "1", "--optimizer-device", "nvme",
                      "--nvme-path", str(swap))
    assert "error" not in rows[0], rows[0]
    assert "offload_optimizer (nvme" in proc.stdout
    assert not list(swap.glob("shardwise_swap/*"))  # removed when the trial's process ended
    proc, rows = _run(tmp_path, "--sw-layers", "1,2", "--host-cap-gib", "0.01")
    assert len(rows) == 1 and "host cap exceeded" in rows[0]["error"]


def test_watchdog_stops_a_trial_when_host_memory_runs_low(tmp_path: Path) -> None:
    # "keep a million GiB free" can never hold: the first trial is stopped, the next skipped
    proc, rows = _run(tmp_path, "--sw-layers", "1,2", "--min-free-gib", "1000000")
    assert len(rows) == 1 and "host memory exhausted" in rows[0]["error"]
    assert "FAILED: host memory exhausted" in proc.stdout
