"""What ``import deepspeed`` gives while ``shardwise.integrations.use_as_deepspeed()`` is on.

The names Hugging Face ``transformers`` and ``accelerate`` (and most DeepSpeed scripts)
reach for, each served by shardwise: ``initialize`` builds a shardwise engine,
``deepspeed.zero`` is ``shardwise.zero``, ``deepspeed.comm`` is ``shardwise.comm``.
Submodules (``deepspeed.utils``, ``deepspeed.ops.adam``, ``deepspeed.runtime.lr_schedules``
...) are the modules next to this file; the alias finder maps the names (alias.py).
"""
from __future__ import annotations

import importlib
from typing import Any

from ..alias import ALIAS_VERSION

__version__ = ALIAS_VERSION
__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in ALIAS_VERSION.split("+")[0].split("."))
__git_hash__ = None
__git_branch__ = None

_LAZY = {
    "initialize": ("shardwise.integrations.engine_adapter", "initialize"),
    "DeepSpeedEngine": ("shardwise.runtime.engine", "ShardwiseEngine"),
    "init_distributed": ("shardwise.comm", "init_distributed"),
    "add_config_arguments": ("shardwise.runtime.initialize", "add_config_arguments"),
    "DeepSpeedConfig": ("shardwise.config", "ShardwiseConfig"),
}
_SUBMODULES = {"zero": "shardwise.zero", "comm": "shardwise.comm",
               "checkpointing": "shardwise.activation",
               "ops": "shardwise.integrations.deepspeed_api.ops",
               "utils": "shardwise.integrations.deepspeed_api.utils",
               "accelerator": "shardwise.integrations.deepspeed_api.accelerator",
               "runtime": "shardwise.integrations.deepspeed_api.runtime",
               "checkpoint": "shardwise.integrations.deepspeed_api.checkpoint"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(
            f"deepspeed.{name} is not part of the DeepSpeed surface shardwise serves through "
            "shardwise.integrations.use_as_deepspeed(); see docs/integrations.md for the list")
    globals()[name] = value
    return value
