"""ZeRO stage 3 with ``offload_param: {device: "nvme"}``: parameter partitions in per-rank
swap files, read ahead of use and written back after each step.

Tiny Hugging Face Llama (grouped-query attention) and OPT built from transformers configs,
every parameter above a low ``stage3_param_persistence_threshold`` partitioned, and
``min_nvme_bytes: 0`` / ``max_in_cpu: 0`` so every partition goes to the disk (DeepSpeed keeps
partitions under 1 MiB in host memory: all of these would). Parameters after N steps must
equal plain single-process AdamW on the global batch, at world sizes 1 and 2 (gloo, spawn).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed._hf_tiny import batches, build, mismatches, reference

STEPS, MICRO, LR = 3, 2, 1e-2
THRESHOLD = 40  # 32-element norms and biases stay whole; everything larger is partitioned
PROMPT = torch.tensor([[3, 14, 15, 9, 2]])
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def nvme_config(nvme_path: str, optimizer: bool = True, **offload_param) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0,
                              "min_nvme_bytes": 0, "buffer_count": 3, **offload_param}}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "zero_optimization": zero}
    if optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    return cfg


def swap_files(root: str) -> List[Path]:
    return sorted(Path(root).rglob("*.swp"))


def full_params(engine) -> Dict[str, torch.Tensor]:
    from shardwise.zero import GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}


def _train(rank: int, world: int, kind: str, nvme_root: str) -> dict:
    """Train STEPS steps on this rank's slice of each global batch; what the test checks."""
    import shardwise
    from shardwise.zero import is_partitioned
    engine, *_ = shardwise.initialize(model=build(kind), config=nvme_config(nvme_root))
    swapper = engine.strategy.params.swapper
    n_parts = sum(1 for p in engine.module.parameters() if is_partitioned(p))
    own_dir = Path(swapper.path)
    for ids in batches(STEPS, MICRO * world):
        mine = ids[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    out = {"params": full_params(engine), "parts": n_parts, "on_nvme": swapper.on_nvme,
           "files_during": len(list(own_dir.glob("*.swp"))), "stats": dict(swapper.stats),
           "numel_outside": max(p.numel() for p in engine.module.parameters() if is_partitioned(p))}
    engine.destroy()
    out["dir_after_destroy"] = own_dir.exists()
    return out


def _check(result: dict, kind: str, world: int) -> None:
    assert result["on_nvme"] == result["parts"] > 0, "every partition goes to the swap files"
    assert result["files_during"] == result["on_nvme"], "one swap file per partition"
    assert result["stats"]["read_ahead_used"] > 0, "the recorded trace read partitions ahead of use"
    assert result["stats"]["writes"] >= STEPS * result["on_nvme"], "updated shards written back"
    assert result["numel_outside"] == 0, "a partitioned parameter left gathered after the step"
    assert not result["dir_after_destroy"], "destroy() removes this rank's swap folder"
    bad = mismatches(result["params"], reference(kind, STEPS, MICRO * world, LR))
    assert not bad, bad


@pytest.mark.parametrize("kind", [pytest.param("llama-gqa", marks=pytest.mark.windows), "opt"])
def test_nvme_params_train_like_plain_torch(kind: str, tmp_path: Path) -> None:
    _check(_train(0, 1, kind, str(tmp_path)), kind, world=1)
    assert not swap_files(str(tmp_path))


@pytest.mark.parametrize("kind", ["llama-gqa", pytest.param("opt", marks=pytest.mark.slow)])
def test_nvme_params_train_like_plain_torch_world2(kind: str, tmp_path: Path) -> None:
    results = run_distributed(_train, 2, kind, str(tmp_path))
    for result in results:
        _check(result, kind, world=2)
    assert not swap_files(str(tmp_path))


@pytest.mark.parametrize("kind", [pytest.param("llama-gqa", marks=pytest.mark.windows), "opt"])
def test_nvme_params_without_optimizer_generate_plain_tokens(kind: str, tmp_path: Path) -> None:
    """The parameters-only route (initialize without an optimizer, ZeRO-Inference style)."""
    import shardwise
    plain = build(kind).eval()
    with torch.no_grad():
        want = plain.generate(PROMPT, **GEN)
    # max_in_cpu is the optimizer side's budget (DeepSpeed): without one every partition is on disk
    cfg = nvme_config(str(tmp_path), optimizer=False, max_in_cpu=10**9)
    engine, optimizer, _, _ = shardwise.initialize(model=build(kind), config=cfg)
    assert optimizer is None
    swapper = engine.strategy.swapper
    assert swapper.on_nvme > 0 and swapper.in_cpu == 0
    assert len(swap_files(str(tmp_path))) == swapper.on_nvme
    engine.eval()
    with torch.no_grad():
        got = engine.module.generate(PROMPT, **GEN)
    assert torch.equal(got, want), (got, want)
    assert swapper.stats["read_ahead_used"] > 0, "generate() follows its own eval trace"
    engine.destroy()
    assert not swap_files(str(tmp_path))


def test_max_in_cpu_and_min_nvme_bytes_keep_partitions_in_host_memory(tmp_path: Path) -> None:
    """DeepSpeed's placement: partitions under min_nvme_bytes and the first max_in_cpu
    elements of the others stay in host memory; the rest are files."""
    import shardwise
    from shardwise.zero.stage3.file_shard import FileShard
    from shardwise.zero.stage3.partition import record_of
    embed = 128 * 32  # the embedding's partition: the first large one in parameter order
    cfg = nvme_config(str(tmp_path), max_in_cpu=embed, min_nvme_bytes=32 * 64 * 4)
    engine, *_ = shardwise.initialize(model=build("llama-gqa"), config=cfg)
    recs = {n: record_of(p) for n, p in engine.module.named_parameters()
            if record_of(p) is not None}
    on_file = {n for n, r in recs.items() if isinstance(r.storage, FileShard)}
    assert "model.embed_tokens.weight" not in on_file  # within max_in_cpu
    assert "model.layers.0.self_attn.q_proj.weight" not in on_file  # 4 KiB < min_nvme_bytes
    assert "model.layers.0.mlp.up_proj.weight" in on_file  # 8 KiB: on the disk
    assert "lm_head.weight" in on_file  # past the max_in_cpu budget
    assert len(swap_files(str(tmp_path))) == len(on_file)
    engine.destroy()


def test_checkpoint_of_nvme_run_resumes_with_cpu_offload(tmp_path: Path) -> None:
    """Checkpoints of an NVMe run are ordinary ones: saved from swap files, loaded into a
    CPU-offload engine (and back into an NVMe one) with the same parameters."""
    import shardwise
    engine, *_ = shardwise.initialize(model=build("llama-gqa"),
                                      config=nvme_config(str(tmp_path / "nvme")))
    for ids in batches(2, MICRO):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    want = full_params(engine)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    engine.destroy()
    cpu_cfg = nvme_config("unused")
    cpu_cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    for cfg in (cpu_cfg, nvme_config(str(tmp_path / "nvme2"))):
        other, *_ = shardwise.initialize(model=build("llama-gqa", seed=1), config=cfg)
        other.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
        got = full_params(other)
        assert all(torch.equal(got[k], want[k]) for k in want), cfg["zero_optimization"]
        other.destroy()


def _tiny_engine(tmp_path: Path, **offload_param):
    import shardwise
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    cfg = nvme_config(str(tmp_path), **offload_param)
    return shardwise.initialize(model=model, config=cfg)[0]


def test_zero_init_with_nvme_builds_in_host_memory_then_initialize_moves_to_files(
        tmp_path: Path) -> None:
    """DeepSpeed scripts pass the same ds_config to zero.Init: remote_device "nvme" builds the
    partitions in host memory and initialize() moves them into its swap files."""
    import shardwise
    from shardwise.zero import Init
    from shardwise.zero.stage3.file_shard import FileShard
    from shardwise.zero.stage3.partition import record_of
    cfg = nvme_config(str(tmp_path))
    with Init(config_dict_or_path=cfg):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    assert record_of(model[0].weight).storage.resident
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).state_dict()
    engine = shardwise.initialize(model=model, config=cfg)[0]
    assert isinstance(record_of(model[0].weight).storage, FileShard)
    assert len(swap_files(str(tmp_path))) == 3
    got = full_params(engine)
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine.destroy()


def test_bad_nvme_settings_are_clear_errors(tmp_path: Path) -> None:
    from shardwise.errors import ConfigError, StorageError
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("x")
    with pytest.raises(StorageError, match="not_a_folder.*regular file"):
        _tiny_engine(a_file)
    with pytest.raises(ConfigError, match="buffer_size = 100 elements.*at least 4096"):
        _tiny_engine(tmp_path / "small", buffer_size=100)
    assert not swap_files(str(tmp_path / "small")), "a refused engine leaves no swap files"
    with pytest.raises(ConfigError, match="buffer_count = 0"):
        _tiny_engine(tmp_path / "zero", buffer_count=0)
    import shardwise
    cfg = nvme_config(str(tmp_path))
    cfg["zero_optimization"]["offload_optimizer"]["delayed_update"] = True
    with pytest.raises(ConfigError, match="delayed_update with offload_param device \"nvme\""):
        shardwise.initialize(model=torch.nn.Linear(64, 64), config=cfg)


@pytest.mark.slow  # a fresh interpreter importing torch (SwapDir's own exit test is fast)
def test_swap_files_removed_at_interpreter_exit(tmp_path: Path) -> None:
    """A training script that never calls destroy() leaves no swap files behind."""
    script = textwrap.dedent(f"""
        import torch, shardwise
        from pathlib import Path
        from tests.distributed.test_zero3_nvme_param import nvme_config
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        engine = shardwise.initialize(model=model, config=nvme_config({str(tmp_path)!r}))[0]
        loss = engine(torch.randn(2, 64)).sum()
        engine.backward(loss)
        engine.step()
        print(len(list(Path({str(tmp_path)!r}).rglob("*.swp"))))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "3", out.stdout  # files existed while it ran
    assert not swap_files(str(tmp_path))
