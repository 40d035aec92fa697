"""Autotuning on a CUDA device: the profiling run, the memory model and a real tune of a tiny
Llama (benchmarks/autotune_train.py) with stages 0 and 3 and checkpointing none/full."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "autotune_train.py"
SHAPE = ["--layers=2", "--hidden=128", "--intermediate=256", "--heads=4", "--kv-heads=2",
         "--vocab=512", "--seq=128"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tune_on_gpu_profiles_prunes_and_picks(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": [0, 3]},
           "activation_checkpointing": {"policy": ["none", "full"], "modules": ["LlamaDecoderLayer"]},
           "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2,
                          "max_train_micro_batch_size_per_gpu": 4, "tuner_type": "model_based",
                          "fast": False, "trial_timeout": 300}}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "shardwise", "--autotuning", "tune", "--num_gpus", "1",
           "--master_port", str(_port()), str(SCRIPT), *SHAPE, "--deepspeed", "--deepspeed_config", "ds.json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "autotuning_exps" / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] > 500_000 and info["activation_mem_per_gpu"] > 0
    assert info["shape"]["num_layers"] == 2 and info["tokens_per_sample"] == 128
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] in (0, 3) and "autotuning" not in optimal
    ok = [json.loads(p.read_text()) for p in (tmp_path / "autotuning_exps").glob("z*/metrics.json")]
    assert ok and all(m["peak_memory"] > 0 and m["flops"] > 0 for m in ok)
    assert "model:" in proc.stdout and "GiB" in proc.stdout


def test_memory_model_prunes_a_micro_batch_that_cannot_fit():
    from shardwise.autotuning.memory import MemoryModel
    from shardwise.autotuning.space import Choice
    total = torch.cuda.get_device_properties(0).total_memory
    info = {"num_params": 1_100_000_000, "activation_mem_per_gpu": total // 8, "micro_batch_size": 1}
    mem = MemoryModel.from_model_info(info, "bf16", 1, total)
    assert mem.fits(Choice(0), 1) and not mem.fits(Choice(0), 16)
