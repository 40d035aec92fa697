"""Config files on Windows paths, and the seed article's Windows-only keys.

A DeepSpeed user on Windows passes ``C:\\...\\ds_config.json`` (backslashes, a drive letter,
often spaces in the folder name). The seed's invented keys must load and do what
docs/config.md says: on Windows ``windows_specific.memory_optimization: "aggressive"`` turns
on ``empty_cache_after_step`` and the others are accepted with a note saying why they change
nothing; elsewhere all of them have no effect and one info line says so. ``platform_key_notes`` is called without a platform override, so the branch for the
platform the tests run on (Windows under the Windows job) is the one exercised.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.windows._helpers import ON_WINDOWS, require

pytestmark = pytest.mark.windows

# Section 3.1 of the seed article (its Windows memory configuration), verbatim in content.
SEED_31 = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2,
             "min_loss_scale": 1},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
}
# Section 3.3: the IO keys.
SEED_33 = {
    "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
            "thread_count": 4, "windows_io_optimization": True},
    "checkpoint": {"use_node_local_storage": True, "windows_path_optimization": True},
}
# Section 4.1: the fine-tuning config with windows_specific.
SEED_41 = {
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                                 "warmup_num_steps": 100}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "gradient_accumulation_steps": 8, "train_micro_batch_size_per_gpu": 4,
    "windows_specific": {"enable": True, "memory_optimization": "aggressive"},
}
# Section 4.2: the inference config.
SEED_42 = {
    "tensor_parallel": {"tp_size": 1, "windows_tp_optimization": True},
    "inference": {"kernel_inject": True, "replace_with_kernel_inject": True,
                  "windows_kernel_optimization": True},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e7},
}


def _load(config, world_size: int = 1):
    return require("shardwise.config", "load_config").load_config(config=config, world_size=world_size)


def _write(folder: Path, name: str, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    # A Windows editor's file: CRLF line ends and a // comment (the loader accepts comments).
    text = "// written by the Windows subset\r\n" + json.dumps(cfg, indent=2).replace("\n", "\r\n")
    path.write_bytes(text.encode("utf-8"))
    return path


def test_config_path_with_drive_letter_and_backslashes(tmp_path: Path) -> None:
    path = _write(tmp_path / "My Configs", "ds_config.json", SEED_41)
    text = str(path)
    if ON_WINDOWS:
        assert text[1:3] == ":\\" and "\\" in text[3:], text  # e.g. Z:\work\...\ds_config.json
        spellings = [text, text.replace("\\", "/"), Path(text)]
    else:
        spellings = [text, Path(text)]
    for spelling in spellings:
        cfg = _load(spelling, world_size=2)
        assert cfg.zero_optimization.stage == 2
        assert cfg.zero_optimization.offload_optimizer_device == "cpu"
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                cfg.gradient_accumulation_steps) == (64, 4, 8)


def test_missing_config_names_the_windows_path(tmp_path: Path) -> None:
    errors = require("shardwise.errors", "ConfigError")
    missing = tmp_path / "nope" / "ds_config.json"
    with pytest.raises(errors.ConfigError) as info:
        _load(str(missing))
    # The message shows the absolute path as the user's OS spells it (backslashes on Windows).
    assert str(missing.resolve()) in str(info.value) or str(missing) in str(info.value)


def test_memory_optimization_aggressive_empties_cache_after_step() -> None:
    cfg = _load(SEED_41)
    assert cfg.windows_specific.enable is True
    assert cfg.windows_specific.memory_optimization == "aggressive"
    assert cfg.empty_cache_after_step is ON_WINDOWS  # a Windows-only setting
    for level in ("normal", "none"):
        other = _load({**SEED_41, "windows_specific": {"enable": True, "memory_optimization": level}})
        assert other.empty_cache_after_step is False, level
    assert _load({"train_micro_batch_size_per_gpu": 1}).empty_cache_after_step is False


def test_windows_specific_notes_follow_the_real_platform() -> None:
    keys = require("shardwise.config.platform_keys", "platform_key_notes")
    notes = keys.platform_key_notes(_load(SEED_41))
    if ON_WINDOWS:
        enable = [n for n in notes if n.startswith("windows_specific.enable")]
        assert len(enable) == 1 and "spawn" in enable[0] and "gloo" in enable[0]
        assert any("aggressive" in n and "empties" in n for n in notes)
    else:
        assert len(notes) == 1 and f"ignored on {keys.platform_name()}" in notes[0]
        assert "windows_specific.memory_optimization=\"aggressive\"" in notes[0]


def test_io_and_inference_keys_are_accepted_with_their_reasons() -> None:
    keys = require("shardwise.config.platform_keys", "platform_key_notes")
    io_cfg = _load(SEED_33)
    assert io_cfg.aio.windows_io_optimization is True
    assert io_cfg.checkpoint.windows_path_optimization is True
    assert io_cfg.aio.thread_count == 4
    io_notes = keys.platform_key_notes(io_cfg, system="Windows")
    assert any(n.startswith("aio.windows_io_optimization: no effect") for n in io_notes)
    assert any(n.startswith("checkpoint.windows_path_optimization: no effect") and "os.replace" in n
               for n in io_notes)
    inf_notes = keys.platform_key_notes(_load(SEED_42), system="Windows")
    assert any(n.startswith("tensor_parallel.windows_tp_optimization: no effect") for n in inf_notes)
    assert any(n.startswith("inference.windows_kernel_optimization: no effect") for n in inf_notes)


def test_seed_memory_config_loads() -> None:
    # Section 3.1 combines offload_param with stage 2: shardwise ignores offload_param there
    # with a warning (only stage 3 partitions parameters) and strict mode makes it an error.
    cfg = _load(SEED_31)
    assert cfg.zero_optimization.stage == 2
    assert cfg.zero_optimization.offload_optimizer_device == "cpu"
    assert cfg.zero_optimization.offload_param_device == "none"
    assert cfg.fp16.enabled and cfg.activation_checkpointing.cpu_checkpointing
    loader = require("shardwise.config", "load_config")
    errors = require("shardwise.errors", "ConfigError")
    with pytest.raises(errors.ConfigError, match="offload_param"):
        loader.load_config(config=SEED_31, world_size=1, strict=True)
