"""Hugging Face Trainer and Accelerate on shardwise through ``use_as_deepspeed()``.

Every scenario runs in a freshly spawned process (tests/distributed/_hf_workers.py turns
the alias on before importing transformers, as a user's script must), so this module never
imports transformers itself. One process runs all one-rank scenarios (a transformers import
costs ~8 s of CPU, paid once); the tests below each check one part of its results.
Reference: the plain Trainer (no DeepSpeed) on the same tiny GPT-2, or a plain PyTorch loop.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict

import pytest
import torch

from tests.dist_utils import run_distributed


def _call(rank: int, world: int, name: str, *args: Any) -> Any:
    # imported inside the worker only: the alias must be on before transformers loads
    workers = importlib.import_module("tests.distributed._hf_workers")
    return getattr(workers, name)(rank, world, *args)


def _ok(result: Dict[str, Any]) -> Dict[str, Any]:
    assert "error" not in result, result.get("error")
    return result


def _assert_params_close(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor],
                         atol: float = 2e-5) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=atol, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def ws1(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_ws1")
    return run_distributed(_call, 1, "scenarios_ws1", str(out))[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_matches_plain_trainer(ws1: Dict[str, Any], stage: int) -> None:
    """TrainingArguments(deepspeed=...) trains on a shardwise engine exactly as the plain
    Trainer does: same losses, grad norms (clipping at max_grad_norm) and weights."""
    plain, ours = _ok(ws1["plain"]), _ok(ws1[f"stage{stage}"])["full"]
    assert ours["engine"] == "HfEngine"
    assert len(ours["losses"]) == 3
    torch.testing.assert_close(ours["losses"], plain["losses"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["grad_norms"], plain["grad_norms"], atol=1e-5, rtol=1e-5)
    _assert_params_close(ours["params"], plain["params"])


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_resume_continues_identically(ws1: Dict[str, Any], stage: int) -> None:
    """A fresh Trainer resumed from checkpoint-2 (engine.save_checkpoint/load_checkpoint via
    the Trainer) continues exactly as the uninterrupted run."""
    run = _ok(ws1[f"stage{stage}"])
    assert "global_step2/shardwise_meta.json" in run["ckpt_files"]
    assert "latest" in run["ckpt_files"]
    if stage == 2:  # Trainer.save_model writes the weights; under stage 3 only when gathered
        assert "model.safetensors" in run["ckpt_files"]
    full, resumed = run["full"], run["resumed"]
    torch.testing.assert_close(resumed["losses"], full["losses"], atol=1e-6, rtol=0)
    _assert_params_close(resumed["params"], full["params"], atol=1e-6)


def test_trainer_fills_auto_values(ws1: Dict[str, Any]) -> None:
    """Every "auto" in the ds_config comes from TrainingArguments / the model (transformers'
    HfTrainerDeepSpeedConfig) and shardwise's config accepts the filled values."""
    auto = _ok(ws1["auto"])
    assert auto["optimizer_type"] == "AdamW"
    assert auto["optimizer"] == {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": 0.01}
    assert auto["scheduler_type"] == "WarmupDecayLR"
    assert auto["scheduler"] == {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                 "warmup_num_steps": 1, "total_num_steps": 3}
    assert auto["batch"] == (4, 2, 2)  # train_batch_size, micro batch, accumulation
    assert auto["clip"] == 1.0
    hidden = 32
    assert auto["zero"] == {"reduce_bucket_size": hidden * hidden,
                            "prefetch_bucket_size": int(0.9 * hidden * hidden),
                            "param_persistence_threshold": 10 * hidden}
    # DeepSpeed's WarmupDecayLR (warmup 1 is raised to 2, as DeepSpeed does): 0, peak, peak
    assert auto["lrs"] == pytest.approx([0.0, 1e-2, 1e-2])
    assert len(auto["losses"]) == 3 and all(l == l for l in auto["losses"])  # noqa: E741


def test_zero3_from_pretrained_loads_into_partitions(ws1: Dict[str, Any]) -> None:
    """With a stage-3 TrainingArguments alive, from_pretrained builds the Llama under
    zero.Init (partitioned) and loads the saved weights exactly; the trained model's
    save_model (stage3_gather_16bit_weights_on_model_save) writes the trained weights and
    evaluate() gives the plain model's loss."""
    z3 = _ok(ws1["zero3_load"])
    assert z3["zero3_enabled"] is True
    assert "model.embed_tokens.weight" in z3["partitioned"]
    assert "model.layers.0.mlp.down_proj.weight" in z3["partitioned"]
    _assert_params_close(z3["loaded"], z3["saved"], atol=0)
    changed = max((z3["trained"][n] - z3["saved"][n]).abs().max().item() for n in z3["saved"])
    assert changed > 1e-3  # it trained
    _assert_params_close(z3["exported"], z3["trained"], atol=0)
    # Trainer.evaluate() on the partitioned model = the plain model with the trained weights
    assert z3["eval_loss"] == pytest.approx(z3["ref_eval_loss"], abs=1e-5)


def test_accelerate_deepspeed_plugin_drives_shardwise(ws1: Dict[str, Any]) -> None:
    """Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)): prepare, accumulate,
    backward, step with accumulation 2 and clipping equal a plain PyTorch loop."""
    acc = _ok(ws1["accelerate"])
    assert acc["engine"] == "HfEngine"
    assert acc["steps"] == 2  # 4 micro batches / accumulation 2
    torch.testing.assert_close(acc["losses"], acc["ref_losses"], atol=1e-5, rtol=0)
    _assert_params_close(acc["params"], acc["ref_params"])


@pytest.mark.slow
def test_trainer_two_ranks_stage3(tmp_path) -> None:
    """Two ranks (gloo), stage 3: the Trainer on shardwise matches the plain Trainer (DDP) in
    losses and weights; checkpoint-2 written by two ranks resumes to the same end."""
    results = run_distributed(_call, 2, "trainer_ws2", str(tmp_path), 3)
    for rank_result in results:
        plain, full = _ok(rank_result["plain"]), _ok(rank_result["full"])
        resumed = _ok(rank_result["resumed"])
        assert full["engine"] == "HfEngine" and plain["engine"] != "HfEngine"
        torch.testing.assert_close(full["losses"], plain["losses"], atol=1e-5, rtol=0)
        _assert_params_close(full["params"], plain["params"])
        torch.testing.assert_close(resumed["losses"], full["losses"], atol=1e-6, rtol=0)
        _assert_params_close(resumed["params"], full["params"], atol=1e-6)
    _assert_params_close(results[0]["full"]["params"], results[1]["full"]["params"], atol=0)


_ACCELERATE_SCRIPT = '''
import shardwise.integrations
shardwise.integrations.use_as_deepspeed()
import json, sys
import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
accelerator = Accelerator()
data = [(torch.randn(8, generator=torch.Generator().manual_seed(i)),
         torch.randn(1, generator=torch.Generator().manual_seed(100 + i))) for i in range(8)]
engine, opt, loader = accelerator.prepare(model, DummyOptim(model.parameters()),
                                          torch.utils.data.DataLoader(data, batch_size=2))
for x, y in loader:
    with accelerator.accumulate(engine):
        accelerator.backward(torch.nn.functional.mse_loss(engine(x), y))
        opt.step()
        opt.zero_grad()
json.dump({"engine": type(engine).__name__, "type": str(accelerator.distributed_type),
           "steps": engine.global_steps, "stage": engine.zero_optimization_stage(),
           "lr": engine.get_lr()}, open(sys.argv[1], "w"))
'''


def test_accelerate_launch_use_deepspeed(tmp_path) -> None:
    """`python -m shardwise.integrations.accelerate_launch --use_deepspeed --deepspeed_config_file
    ds.json train.py`: accelerate's own launcher (its DeepSpeed check passes) starts a script
    whose Accelerator builds a shardwise engine from the plugin's config file."""
    import json
    import os
    import subprocess
    import sys
    script, out, cfg = tmp_path / "train.py", tmp_path / "out.json", tmp_path / "ds.json"
    script.write_text(_ACCELERATE_SCRIPT)
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2}}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise.integrations.accelerate_launch", "--use_deepspeed",
         "--deepspeed_config_file", str(cfg), "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got == {"engine": "HfEngine", "type": "DistributedType.DEEPSPEED", "steps": 2,
                   "stage": 2, "lr": [0.01]}
