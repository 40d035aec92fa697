"""The seed article's config examples (sections 3.1, 3.3, 4.1, 4.2) and its Windows keys."""
from __future__ import annotations

import json

import pytest
import torch

from shardwise.config import load_config, platform_key_notes
from shardwise.config import platform_keys
from shardwise.config.platform_keys import platform_name
from shardwise.errors import ConfigError

# Section 3.1, as printed (a Python dict): stage 2 with offload_param.
SEED_3_1 = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": {"device": "cpu", "pin_memory": True}},
            "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
                     "min_loss_scale": 1},
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
# Section 3.3, as printed (JSON).
SEED_3_3 = """{ "aio": { "block_size": 1048576, "queue_depth": 8, "single_submit": false,
  "overlap_events": true, "thread_count": 4, "windows_io_optimization": true },
  "checkpoint": { "use_node_local_storage": true, "windows_path_optimization": true } }"""
# Section 4.1's ds_config.
SEED_4_1 = {"optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                                         "warmup_num_steps": 100}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "gradient_accumulation_steps": 8, "train_micro_batch_size_per_gpu": 4,
            "windows_specific": {"enable": True, "memory_optimization": "aggressive"}}
# Section 4.2's inference_config.
SEED_4_2 = {"tensor_parallel": {"tp_size": 1, "windows_tp_optimization": True},
            "inference": {"kernel_inject": True, "replace_with_kernel_inject": True,
                          "windows_kernel_optimization": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "stage3_param_persistence_threshold": 1e5,
                                  "stage3_max_live_parameters": 1e7}}


def _no_unknown(cfg):
    assert not [w for w in cfg.warnings if w.startswith("Unknown config key")]


@pytest.fixture(params=["Windows", "Linux"])
def system(request, monkeypatch):
    """Run the test as if on Windows and as if on Linux (the config's one platform check)."""
    monkeypatch.setattr(platform_keys, "current_system", lambda: request.param)
    return request.param


def _windows_texts(texts):
    return [t for t in texts if "windows" in t.lower()]


def test_seed_3_1_loads_and_warns_about_offload_param():
    cfg = load_config(SEED_3_1)
    _no_unknown(cfg)
    assert cfg.train_batch_size == 32 and cfg.compute_dtype == torch.float16
    assert cfg.zero_optimization.offload_optimizer_device == "cpu"
    assert cfg.zero_optimization.offload_param_device == "none"  # stage 2: ignored, as DeepSpeed does
    assert [w for w in cfg.warnings if "offload_param" in w and "needs ZeRO stage 3" in w]
    assert cfg.activation_checkpointing.cpu_checkpointing is True


def test_seed_3_3_json_loads_with_no_effect_notes(tmp_path, system):
    path = tmp_path / "ds_config.json"
    path.write_text(SEED_3_3, encoding="utf-8")
    cfg = load_config(path)
    _no_unknown(cfg)
    assert cfg.aio.thread_count == 4 and cfg.checkpoint.use_node_local_storage is True
    if system == "Windows":
        assert any(w.startswith("aio.windows_io_optimization: no effect") for w in cfg.warnings)
        assert any(w.startswith("checkpoint.windows_path_optimization: no effect") and "pathlib" in w
                   for w in cfg.warnings)
        assert cfg.infos == []
    else:
        assert _windows_texts(cfg.warnings) == []
        assert cfg.infos == ["Windows-only config keys ignored on Linux (no effect here; they apply "
                             "on Windows only): aio.windows_io_optimization, "
                             "checkpoint.windows_path_optimization."]


def test_seed_4_1_memory_effect_on_windows_only(system):
    cfg = load_config(SEED_4_1)
    _no_unknown(cfg)
    assert cfg.train_batch_size == 32 and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["betas"] == [0.9, 0.999] and cfg.scheduler.params["warmup_max_lr"] == 5e-5
    if system == "Windows":
        assert cfg.empty_cache_after_step is True
        assert any(w.startswith("windows_specific.enable") and "always on" in w for w in cfg.warnings)
        assert any("memory_optimization=\"aggressive\"" in w and "empties" in w for w in cfg.warnings)
    else:
        assert cfg.empty_cache_after_step is False
        assert _windows_texts(cfg.warnings) == []
        assert len(cfg.infos) == 1 and "ignored on Linux" in cfg.infos[0]
        assert "windows_specific.enable, windows_specific.memory_optimization=\"aggressive\"" \
            in cfg.infos[0]


def test_seed_4_2_loads_with_notes(system):
    cfg = load_config(SEED_4_2)
    _no_unknown(cfg)
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.offload_param_device == "cpu"
    assert zero.param_persistence_threshold == 100_000 and zero.max_live_parameters == 10_000_000
    assert cfg.tensor_parallel == {"tp_size": 1, "windows_tp_optimization": True}
    if system == "Windows":
        assert any(w.startswith("tensor_parallel.windows_tp_optimization: no effect") for w in cfg.warnings)
        assert any(w.startswith("inference.windows_kernel_optimization: no effect") for w in cfg.warnings)
    else:
        assert "tensor_parallel.windows_tp_optimization, inference.windows_kernel_optimization" \
            in cfg.infos[0]
    assert any("'inference'" in w and "no effect" in w for w in cfg.warnings)
    assert not any("'tensor_parallel'" in w for w in cfg.warnings)  # tp_size 1: nothing asked


def test_seed_configs_round_trip_and_strict_behaviour():
    for raw in (SEED_4_1, SEED_4_2):
        cfg = load_config(raw, strict=True)  # every seed key is known
        assert load_config(json.loads(json.dumps(cfg.to_dict()))).to_dict() == cfg.to_dict()
    with pytest.raises(ConfigError, match="offload_param"):
        load_config(SEED_3_1, strict=True)


@pytest.mark.parametrize("name", ["Linux", "Windows", "Darwin"])
def test_platform_key_notes_per_platform(name):
    cfg = load_config(SEED_4_1)
    notes = platform_key_notes(cfg, system=name)
    if name == "Windows":
        enable = [n for n in notes if n.startswith("windows_specific.enable")]
        assert len(enable) == 1 and "always on" in enable[0]
    else:
        assert len(notes) == 1 and f"ignored on {platform_name(name)}" in notes[0]
        assert "windows_specific.enable" in notes[0]
    assert platform_name("Darwin") == "macOS"


@pytest.mark.parametrize("level, empties", [("aggressive", True), ("normal", False), ("none", False),
                                            ("AGGRESSIVE", True)])
def test_memory_optimization_levels(level, empties, system):
    cfg = load_config({"windows_specific": {"memory_optimization": level}})
    assert cfg.empty_cache_after_step is (empties and system == "Windows")
    notes = platform_key_notes(cfg)
    assert bool([n for n in notes if "memory_optimization" in n]) is (level.lower() != "none")
    with pytest.raises(ConfigError, match="memory_optimization"):
        load_config({"windows_specific": {"memory_optimization": "extreme"}})


def test_no_seed_keys_no_notes(system):
    assert platform_key_notes(load_config({"zero_optimization": {"stage": 1}})) == []
