"""The accelerator abstraction on this machine (CPU) and its forced selection."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import shardwise
from shardwise.accelerator import Accelerator
from shardwise.errors import ConfigError


def test_cpu_accelerator_names_gloo_and_behaves_like_a_device() -> None:
    acc = Accelerator("cpu")
    assert acc.is_available() and acc.device_count() == 1
    assert acc.device(3) == torch.device("cpu")
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    t = torch.ones(3)
    assert acc.pin_memory(t) is t  # no pinning without a GPU
    assert acc.Stream() is None and not acc.has_streams()
    with acc.stream(None):
        pass
    assert acc.total_memory() > 0
    free, total = acc.mem_get_info()
    assert 0 < free <= total == acc.total_memory()


def test_unknown_accelerator_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="valid are cuda, xpu, mps, cpu"):
        Accelerator("tpu")


def test_environment_forces_the_accelerator() -> None:
    code = "import shardwise; print(shardwise.get_accelerator().kind)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"}, timeout=60)
    assert out.stdout.strip() == "cpu", out.stderr
    assert shardwise.get_accelerator().kind in ("cpu", "cuda", "xpu", "mps")


def test_large_pinned_blocks_setting_respects_the_user_and_old_torch(monkeypatch):
    """The pinned-rounding threshold goes to torch once per process; a threshold the user
    put in PYTORCH_CUDA_ALLOC_CONF wins, and a torch that rejects the key keeps rounding."""
    import torch
    from shardwise.accelerator import base

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(base, "_PINNED_ROUNDING_DONE", {})
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert base.exact_large_pinned_blocks("cpu") is True
    assert base.exact_large_pinned_blocks("cpu") is True  # cached: asked once
    assert calls == [f"pinned_max_round_threshold_mb:{base.PINNED_ROUND_THRESHOLD_MB}"]

    monkeypatch.setattr(base, "_PINNED_ROUNDING_DONE", {})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_max_round_threshold_mb:1024")
    assert base.exact_large_pinned_blocks("cpu") is False and len(calls) == 1

    def reject(setting):
        raise RuntimeError(f"Unrecognized key in {setting}")

    monkeypatch.setattr(base, "_PINNED_ROUNDING_DONE", {})
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", reject, raising=False)
    assert base.exact_large_pinned_blocks("cpu") is False
