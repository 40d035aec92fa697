"""benchmarks/hook_bench.py: per-phase host time of ZeRO variants on a tiny model (CPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import hook_bench  # noqa: E402


def test_table_gives_times_then_ratios_to_the_first_variant():
    rows = {"z2": {"forward": 2.0, "backward": 4.0, "step": 1.0},
            "z3": {"forward": 3.0, "backward": 6.0, "step": 0.5}}
    lines = hook_bench.table(rows).splitlines()
    assert lines[1].split() == ["z2", "2.00", "4.00", "1.00"]
    assert lines[-1].split() == ["z3", "1.50", "1.50", "0.50"]


def test_runs_stage_2_and_3_on_cpu():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hook_bench.py"), "--device", "cpu",
                           "--layers", "2", "--steps", "1", "--variants", "z2,z3"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ratios = proc.stdout.split("x z2")[1].splitlines()
    z3 = next(line for line in ratios if line.startswith("z3")).split()
    assert len(z3) == 4 and all(float(v) > 0 for v in z3[1:])


def test_unknown_variant_is_named():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hook_bench.py"), "--device", "cpu",
                           "--variants", "z9"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "z9" in proc.stderr
