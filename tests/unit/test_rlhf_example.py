"""examples/rlhf_ppo.py runs (issue 23): a short PPO loop on CPU with the hybrid-engine actor."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhf_ppo.py"


def test_rlhf_ppo_example_runs_two_iterations():
    spec = importlib.util.spec_from_file_location("rlhf_ppo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    totals = module.main(["--iters", "2", "--batch", "2", "--prompt-len", "24", "--gen-len", "6"])
    assert totals["iters"] == 2
    assert totals["gen_s"] > 0 and totals["train_s"] > 0
    assert math.isfinite(totals["actor_loss"]) and math.isfinite(totals["critic_loss"])
