"""The benchmark harness end to end on a tiny model: subprocess workers, world sizes 1 and 2
(through the shardwise launcher), the JSON results and the ratio table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--intermediate", "64",
        "--heads", "2", "--kv-heads", "1", "--vocab", "128", "--seq", "16",
        "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--grad-accum", "2"]


@pytest.mark.parametrize("nproc,variants", [(1, "torch,fsdp2,sw_z2,sw_z2_monitors"),
                                            (2, "ddp,sw_z2")])
def test_train_bench_tiny_cpu(tmp_path: Path, nproc: int, variants: str) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_bench.py"), *TINY,
         "--nproc", str(nproc), "--variants", variants, "--out", str(out), "--timeout", "150"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == set(variants.split(","))
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and len(row["step_times"]) == 2
        assert row["world_size"] == nproc
    # same weights and data: shardwise ZeRO-2 tracks the plain-torch baseline
    base = rows.get("torch") or rows["ddp"]
    assert abs(rows["sw_z2"]["loss_last"] - base["loss_last"]) < 0.05
    assert "tokens/s" in proc.stdout
    if "sw_z2_monitors" in rows:  # monitors on: same losses, a CSV run flushed at exit
        assert rows["sw_z2_monitors"]["loss_last"] == rows["sw_z2"]["loss_last"]
        assert "sw_z2_monitors_overhead" in json.loads(out.read_text())
        lines = (tmp_path / "monitors" / "sw_z2_monitors" /
                 "Train_Samples_train_loss.csv").read_text().splitlines()
        assert lines[0] == "step,train_loss" and len(lines) == 1 + 3  # warm-up + timed steps
