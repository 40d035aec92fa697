"""shardwise: DeepSpeed-compatible ZeRO training on plain PyTorch, with nothing to compile.

The public surface is this module: ``initialize``, ``add_config_arguments``,
``init_distributed``, ``get_accelerator``, the ``comm``, ``zero``, ``checkpointing`` and
``utils`` namespaces and the memory estimators. Submodules load lazily, so
``import shardwise`` stays fast and never compiles anything.
"""
from __future__ import annotations

import importlib
from typing import Any

from .accelerator import get_accelerator
from .errors import CheckpointError, ConfigError, LaunchError, ShardwiseError
from .version import __version__

_LAZY = {
    "initialize": ("shardwise.runtime.initialize", "initialize"),
    "add_config_arguments": ("shardwise.runtime.initialize", "add_config_arguments"),
    "init_distributed": ("shardwise.comm", "init_distributed"),
    "ShardwiseEngine": ("shardwise.runtime.engine", "ShardwiseEngine"),
    "estimate_memory": ("shardwise.profiling.memory_estimator", "estimate_memory"),
    "estimate_zero2_model_states_mem_needs_all_live":
        ("shardwise.profiling.memory_estimator", "estimate_zero2_model_states_mem_needs_all_live"),
    "estimate_zero3_model_states_mem_needs_all_live":
        ("shardwise.profiling.memory_estimator", "estimate_zero3_model_states_mem_needs_all_live"),
    "init_inference": ("shardwise.inference.engine", "init_inference"),
    "OnDevice": ("shardwise.inference.on_device", "OnDevice"),
}
_SUBMODULES = {"comm": "shardwise.comm", "zero": "shardwise.zero", "utils": "shardwise.utils",
               "checkpointing": "shardwise.activation", "checkpoint": "shardwise.checkpoint",
               "config": "shardwise.config", "ops": "shardwise.ops"}
_SUBMODULES["monitor"] = "shardwise.monitor"

__all__ = ["__version__", "get_accelerator", "ConfigError", "CheckpointError", "LaunchError",
           "ShardwiseError", *_LAZY, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    globals()[name] = value
    return value
