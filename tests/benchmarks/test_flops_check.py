"""benchmarks/flops_check.py on a tiny Llama on CPU: the profiler's fwd+bwd FLOPs/token match
train_bench's analytic 6N + 12Lhs within 5% (the script's pass rule), with exact MACs, and the
engine's profile_step (``--engine``) counts the same matmuls."""
from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks._load import load_bench

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128",
        "--heads", "4", "--kv-heads", "2", "--vocab", "256", "--seq", "32", "--micro-batch", "2"]


def _load_script():
    return load_bench('flops_check')


def test_flops_check_tiny_cpu(tmp_path: Path) -> None:
    out = tmp_path / "flops.json"
    assert _load_script().main([*TINY, "--engine", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert abs(got["ratio"] - 1.0) <= 0.05
    assert got["engine_fwd_macs"] == got["fwd_macs"]  # the engine's profile_step counts the same
    # the matmul part is exact: 6 x fwd MACs / tokens == 6N + 12Lhs, where N's RMSNorm weights
    # (2 per layer and the final one, hidden each) do no matmul
    norm_params = (2 * 2 + 1) * 64
    assert 6 * got["fwd_macs"] / got["tokens"] == got["analytic_flops_per_token"] - 6 * norm_params
    assert got["profiled_params"] == got["n_params"]
