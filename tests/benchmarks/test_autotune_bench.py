"""benchmarks/autotune_bench.py without launching anything: its space, config and table."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import autotune_bench as bench  # noqa: E402

from shardwise.autotuning.cli import load_autotuning  # noqa: E402
from shardwise.autotuning.space import build_space  # noqa: E402


def test_quick_mode_caps_the_grid():
    args = bench.parse_args(["--quick"])
    raw = bench.user_config(args)
    space = build_space(raw, load_autotuning(raw), 1)
    assert space.grid_size() == 12 and args.seq == 1024 and space.ac_policies == ["none", "full"]
    ds = bench.user_config(args, ours=False)
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and "trial_timeout" not in ds["autotuning"]
    assert ds["optimizer"]["params"]["torch_adam"] is True and "activation_checkpointing" not in ds


def test_full_space_has_checkpointing_and_every_stage():
    args = bench.parse_args(["--compile"])
    raw = bench.user_config(args)
    space = build_space(raw, load_autotuning(raw), 1)
    assert space.stages == [0, 1, 2, 3] and space.ac_policies == ["none", "selective", "full"]
    assert space.compile == [False, True] and space.micro_batches == [2, 4, 8, 16, 32]


def test_ratios_use_the_grids_measurement_of_each_pick():
    grid = {"method": "grid", "trials": 12, "wall_s": 600.0, "pick": "z1_tmbspg8_gas1",
            "measured": {"z1_tmbspg8_gas1": 10.0, "z2_tmbspg8_gas1": 9.7}}
    tuner = {"method": "tuner", "trials": 4, "wall_s": 180.0, "pick": "z2_tmbspg8_gas1"}
    rows = [grid, tuner]
    bench.add_ratios(rows, grid, seq=1024)
    assert tuner["vs_best"] == 0.97 and tuner["tokens_s"] == 9.7 * 1024
    assert round(tuner["trials_ratio"], 3) == 0.333 and tuner["wall_ratio"] == 0.3
    table = bench.format_table(rows, bench.COLUMNS)
    assert table.splitlines()[-1].startswith("tuner") and "0.970" in table


def test_pdsh_stand_in_runs_deepspeeds_cleanup_command_here(tmp_path):
    import os
    import subprocess
    env, note = bench.pdsh_env(tmp_path, {"PATH": "/usr/bin:/bin"})  # no pdsh on this PATH
    assert note and env["PATH"].startswith(str(tmp_path / "bin"))
    target = tmp_path / "ran"
    # what DeepSpeed's scheduler runs after each experiment, with a harmless command
    out = subprocess.run(["pdsh", "-f", "1024", "-w", "localhost", "touch", str(target)],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0 and target.exists(), out.stderr
    real = tmp_path / "real"
    real.mkdir()
    (real / "pdsh").write_text("#!/bin/sh\n")
    (real / "pdsh").chmod(0o755)
    assert bench.pdsh_env(tmp_path / "x", {"PATH": str(real)}) == ({"PATH": str(real)}, None)
    assert os.access(tmp_path / "bin" / "pdsh", os.X_OK)
