"""The launcher: ``shardwise [flags] script.py ...`` through torch.distributed.run's elastic agent.

Modules (each one concern): ``cli_args`` (flags), ``hostfile`` (hostfile, include/exclude),
``env`` (forwarded variables, env files), ``single_node`` (one node's elastic agent),
``multi_node`` (ssh/pdsh/slurm/openmpi/local runners), ``worker`` (the worker-side shim:
core binding, USE_LIBUV), ``torch_compat`` (Windows fixes for torch's agent),
``launch`` (ties them together) and ``script_args`` (the script-side flags).

Nothing is imported eagerly: ``python -m shardwise.launcher.single_node`` must not find its
own module already loaded, and the script side should not pay for the launcher.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "launch": ("shardwise.launcher.launch", "launch"),
    "main": ("shardwise.launcher.launch", "main"),
    "add_config_arguments": ("shardwise.launcher.script_args", "add_config_arguments"),
    "apply_script_args": ("shardwise.launcher.script_args", "apply_script_args"),
    "ScriptArgEffects": ("shardwise.launcher.script_args", "ScriptArgEffects"),
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.launcher' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
