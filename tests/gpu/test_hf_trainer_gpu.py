"""transformers' Trainer on shardwise (use_as_deepspeed) on CUDA: fp32 parity with the plain
Trainer at stages 2 and 3, and bf16 with "auto" precision. The scenarios run in a fresh
process (tests/distributed/_hf_workers.py turns the alias on before transformers loads)."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.test_hf_integration import _assert_params_close, _call, _ok

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_trainer_on_cuda_matches_plain_trainer_and_runs_bf16(tmp_path) -> None:
    results = run_distributed(_call, 1, "gpu_scenarios", str(tmp_path), backend="nccl")[0]
    plain = _ok(results["plain"])
    for stage in (2, 3):
        ours = _ok(results[f"stage{stage}"])
        assert ours["engine"] == "HfEngine"
        torch.testing.assert_close(ours["losses"], plain["losses"], atol=1e-4, rtol=0)
        _assert_params_close(ours["params"], plain["params"], atol=1e-4)
    bf16 = _ok(results["bf16"])
    assert bf16["device"].startswith("cuda") and bf16["dtype"] == "torch.bfloat16"
    # bf16 weights: the same run within bf16 rounding
    torch.testing.assert_close(bf16["losses"], plain["losses"], atol=5e-2, rtol=0)
