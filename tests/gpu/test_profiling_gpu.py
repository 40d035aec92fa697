"""The flops profiler and comms logger on a CUDA device: FLOPs/token of a mid-size Llama
within 5% of 6N + 12Lhs (bf16, flash/efficient SDPA kernels), the engine's profile with the
accelerator's peak and MFU, and collectives on CUDA tensors timed and sized."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
MID = ["--device", "cuda", "--layers", "4", "--hidden", "1024", "--intermediate", "2816",
       "--heads", "16", "--kv-heads", "4", "--vocab", "32000", "--seq", "1024",
       "--micro-batch", "2"]


def test_flops_per_token_matches_the_analytic_count(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("flops_check", REPO / "benchmarks" / "flops_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "flops.json"
    assert script.main([*MID, "--engine", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert abs(got["ratio"] - 1.0) <= 0.05
    norm_params = (2 * 4 + 1) * 1024
    assert 6 * got["fwd_macs"] / got["tokens"] == got["analytic_flops_per_token"] - 6 * norm_params
    assert got["engine_fwd_macs"] == got["fwd_macs"]  # the engine counts the same matmuls
    assert got["engine_tflops_per_gpu"] > 1.0


def test_engine_report_has_peak_and_mfu(tmp_path: Path) -> None:
    import shardwise
    from shardwise.profiling.peak_flops import device_peak_flops
    from tests.distributed._parity import engine_config, global_batches, make_model
    report = tmp_path / "profile.txt"
    cfg = engine_config(stage=2, micro=4, ga=1, clip=0.0, lr=1e-2, bf16={"enabled": True},
                        flops_profiler={"enabled": True, "profile_step": 1,
                                        "output_file": str(report)})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    for x, y in global_batches(3, 4):
        engine.backward(engine(x.cuda(), y.cuda()))
        engine.step()
    text = report.read_text()
    assert "Profile Summary at step 1:" in text
    if device_peak_flops() is not None:  # a GPU in the peak table (H100/H200/A100, ...)
        assert re.search(r"MFU = 3 \* fwd flops per GPU / iter latency / peak FLOPS:\s+[\d.]+%", text)


def _comms_on_cuda(rank: int, world: int):
    from shardwise import comm
    torch.cuda.set_device(0)
    comm.configure(enabled=True)
    t = torch.ones(1000, device="cuda")
    comm.all_reduce(t, async_op=True).wait()
    out = torch.empty(2000, device="cuda")
    comm.all_gather_flat(out, t, async_op=True).wait()
    summary = comm.log_summary(return_dict=True)["summary"]
    return {op: {s: r["count"] for s, r in by.items()} for op, by in summary.items()}


def test_comms_logger_on_cuda_tensors() -> None:
    for res in run_distributed(_comms_on_cuda, 2):
        assert res == {"all_reduce": {4000: 1}, "all_gather_into_tensor": {4000: 1}}
