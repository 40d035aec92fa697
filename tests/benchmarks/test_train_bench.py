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
         "--nproc", str(nproc), "--variants", variants, "--out", str(out), "--timeout", "150",
         "--loss-steps", "3"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == set(variants.split(","))
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and len(row["step_times"]) == 2
        # the GC time of each timed step beside it, and the median step
        assert len(row["gc_pause_s"]) == 2 and all(0 <= g <= t for g, t in zip(row["gc_pause_s"], row["step_times"]))
        assert min(row["step_times"]) <= row["step_s_median"] <= max(row["step_times"])
        assert len(row["loss_curve"]) == 3  # warm-up step included
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
    # --loss-steps: the agreement table, every variant within bf16 noise of the reference
    agreement = json.loads(out.read_text())["loss_agreement"]
    assert {a["variant"] for a in agreement} == set(rows)
    assert all(a["verdict"] == "ok" and a["steps"] == 3 for a in agreement), agreement
    assert "loss agreement" in proc.stdout


def test_measure_records_gc_pauses_per_step() -> None:
    """A step that runs the garbage collector shows its time in gc_pause_s, one that does not
    shows none: a slow step can be told from a GC pause."""
    import gc

    import torch

    from tests.benchmarks._load import BENCH_DIR
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    import _common as common
    cfg = common.BenchConfig(device="cpu", warmup=0, steps=4)
    calls = iter(range(4))

    def step() -> torch.Tensor:
        if next(calls) % 2:
            junk = [[i] for i in range(200_000)]  # something for the collector to walk
            gc.collect()
            del junk
        return torch.zeros(())

    gc.disable()  # only the explicit collections (callbacks still run for them)
    try:
        m = common.measure(step, cfg, torch.device("cpu"), setup_s=0.0)
    finally:
        gc.enable()
    assert len(m.gc_pause_s) == len(m.step_times) == 4
    assert m.gc_pause_s[0] == 0.0 and m.gc_pause_s[2] == 0.0
    assert m.gc_pause_s[1] > 0 and m.gc_pause_s[3] > 0
    assert all(g <= t for g, t in zip(m.gc_pause_s, m.step_times))
