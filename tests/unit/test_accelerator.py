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


def test_unknown_accelerator_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="valid are cuda, xpu, mps, cpu"):
        Accelerator("tpu")


def test_environment_forces_the_accelerator() -> None:
    code = "import shardwise; print(shardwise.get_accelerator().kind)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"}, timeout=60)
    assert out.stdout.strip() == "cpu", out.stderr
    assert shardwise.get_accelerator().kind in ("cpu", "cuda", "xpu", "mps")
