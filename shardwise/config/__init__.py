"""DeepSpeed-compatible configuration: ``load_config`` -> ``ShardwiseConfig``.

The reference of every key is docs/config.md.
"""
from __future__ import annotations

from .base import ConfigModel, canonical_dtype_name
from .batch import resolve_batch
from .ignored import IGNORED_SECTIONS
from .loader import STRICT_ENV, load_config
from .models import (ActivationCheckpointingConfig, AioConfig, BF16Config, CheckpointConfig,
                     CompileConfig, DataTypesConfig, FP16Config, OptimizerConfig, SchedulerConfig,
                     TorchAutocastConfig, WindowsSpecificConfig)
from .platform_keys import platform_key_notes
from .profiling import CommsLoggerConfig, FlopsProfilerConfig
from .shardwise_config import ShardwiseConfig
from .zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "load_config", "ShardwiseConfig", "platform_key_notes", "resolve_batch", "IGNORED_SECTIONS",
    "STRICT_ENV", "ConfigModel", "canonical_dtype_name", "ZeroConfig", "OffloadOptimizerConfig",
    "OffloadParamConfig", "FP16Config", "BF16Config", "TorchAutocastConfig", "OptimizerConfig",
    "SchedulerConfig", "ActivationCheckpointingConfig", "CheckpointConfig", "AioConfig",
    "DataTypesConfig", "WindowsSpecificConfig", "CompileConfig",
    "FlopsProfilerConfig", "CommsLoggerConfig",
]
