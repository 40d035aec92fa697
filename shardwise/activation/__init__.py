"""Activation checkpointing, public as ``shardwise.checkpointing`` (DeepSpeed's names).

``configure`` / ``checkpoint`` / ``non_reentrant_checkpoint`` / ``is_configured`` / ``reset``
mirror ``deepspeed.checkpointing``; ``get_cuda_rng_tracker`` and
``model_parallel_cuda_manual_seed`` keep dropout identical on recompute; ``apply`` wraps
module classes of an unmodified model with the ``full``, ``selective`` or ``offload`` policy.
"""
from .api import (ActivationCheckpointingPlan, CheckpointingSettings, checkpoint, configure,
                  configure_from_engine, get_profile, is_configured, model_parallel_reconfigure_tp_seed,
                  non_reentrant_checkpoint, reset)
from .cpu_offload import OffloadSavedTensors, SavedTensorStats
from .policies import POLICIES, ApplyResult, apply, offload_stats, remove
from .rng import CudaRNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed

__all__ = ["ActivationCheckpointingPlan", "ApplyResult", "CheckpointingSettings",
           "CudaRNGStatesTracker", "OffloadSavedTensors", "POLICIES", "SavedTensorStats", "apply",
           "checkpoint", "configure", "configure_from_engine", "get_cuda_rng_tracker", "get_profile",
           "is_configured", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "non_reentrant_checkpoint", "offload_stats", "remove", "reset"]
