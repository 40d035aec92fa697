"""Optimizers and LR schedulers under DeepSpeed's config names.

``build_optimizer("AdamW", params, {"lr": 3e-4})`` and
``build_scheduler("WarmupLR", optimizer, {...})`` turn a ds_config's ``optimizer`` and
``scheduler`` sections into torch objects; ``Lamb`` and ``Lion`` are pure-PyTorch
implementations of DeepSpeed's fused ones.
"""
from .lamb import Lamb
from .lion import Lion
from .registry import OPTIMIZER_NAMES, build_optimizer
from .schedulers import (SCHEDULER_NAMES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR,
                         WarmupLR, build_scheduler)

__all__ = ["build_optimizer", "OPTIMIZER_NAMES", "build_scheduler", "SCHEDULER_NAMES", "Lamb",
           "Lion", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
