"""benchmarks/offload_step_bench.py: the offloaded CPU optimizer step timed bucket by bucket."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import offload_step_bench  # noqa: E402


def test_buckets_are_views_of_one_buffer_with_gradients():
    buckets = offload_step_bench.make_buckets(2500, 1000, pin=False)
    assert [sum(p.numel() for p in b) for b in buckets] == [1000, 1000, 500]
    for b in buckets:
        base = b[0].untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == base and p.grad is not None for p in b)


def test_one_pass_steps_every_bucket_once_and_gives_the_gradients_back():
    buckets = offload_step_bench.make_buckets(3000, 1000, pin=False)
    params = [p for b in buckets for p in b]
    before = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    calls = []
    seconds = offload_step_bench.one_pass(opt, buckets, lambda step: (calls.append(1), step()))
    assert seconds > 0 and len(calls) == len(buckets)
    # AdamW's first step moves every element by about lr (sign of the gradient), once
    for p, b0 in zip(params, before):
        assert torch.allclose((b0 - p).abs(), torch.full_like(p, 1e-2), rtol=0.05, atol=2e-4)
    assert all(p.grad is g for p, g in zip(params, grads))
    assert all(int(s["step"]) == 1 for s in opt.state.values())


def test_runs_on_cpu_and_prints_ratios_last():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "offload_step_bench.py"),
                           "--params-m", "4", "--bucket-m", "1", "--repeats", "1",
                           "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[-1] == "first" and float(lines[1].split()[-1]) == 1.0
    assert all(float(line.split()[-2]) > 0 for line in lines[1:])
