"""Autotuning: ``shardwise --autotuning tune|run`` finds the fastest config that fits.

Modules, each one concern: ``config`` (the ``autotuning`` section, DeepSpeed's keys and
defaults), ``space`` (what ``"auto"`` marks as tunable, experiment names and configs),
``memory`` (pruning with the memory estimator, calibrated by one profiling run),
``tuner`` (the order experiments run in: gridsearch, random, model_based), ``runner`` (one
trial through the launcher, with a timeout, its result read back, resumable), ``autotuner``
(the loop and the result files), ``cli`` (the launcher's entry) and ``engine_probe`` (the
engine side: time the profile steps, write metrics.json, exit).

Nothing is imported eagerly: the engine only pays for ``engine_probe`` when a trial runs.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "AutotuningConfig": ("shardwise.autotuning.config", "AutotuningConfig"),
    "Autotuner": ("shardwise.autotuning.autotuner", "Autotuner"),
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.autotuning' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
