"""ZeRO: stages 0-2 (``data_parallel``), stage 3 (``stage3``), ``Init`` and ``GatheredParameters``.

Names load lazily so that ``import shardwise.zero`` stays light (no strategy, no config).
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Init": ("shardwise.zero.init", "Init"),
    "GatheredParameters": ("shardwise.zero.init", "GatheredParameters"),
    "register_external_parameter": ("shardwise.zero.init", "register_external_parameter"),
    "unregister_external_parameter": ("shardwise.zero.init", "unregister_external_parameter"),
    "ShardView": ("shardwise.zero.shard_view", "ShardView"),
    "is_partitioned": ("shardwise.zero.stage3.partition", "is_partitioned"),
    "full_numel": ("shardwise.zero.stage3.partition", "full_numel"),
    "full_shape": ("shardwise.zero.stage3.partition", "full_shape"),
    "Stage3Strategy": ("shardwise.zero.stage3", "Stage3Strategy"),
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.zero' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
