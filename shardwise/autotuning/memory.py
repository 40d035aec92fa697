"""Pruning: drop experiments the memory estimator says cannot fit, before running them.

The estimator (``shardwise/profiling/memory_estimator.py``) gives the model states per
device for a ZeRO stage and offload choice from the parameter count. Activations come from
one profiling run of the real model (``model_info.json``: the bytes its forward kept for a
micro batch of one), scaled by the micro batch and, for activation checkpointing, by the
estimator's ratio of checkpointed to plain activations for the model's transformer shape
(fixed ratios when the model has no transformers config). An experiment is pruned when the
sum exceeds ``SAFETY`` of the device's memory; with the device memory unknown (CPU) nothing
is pruned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..profiling.memory_estimator import ModelShape, _row, estimate_activations, ActivationEstimate
from .space import Choice

SAFETY = 0.9
"""Fraction of the device memory an experiment may be predicted to use."""
FALLBACK_AC_RATIO = {"none": 1.0, "selective": 0.6, "full": 0.25, "selective_ops": 0.6,
                     "offload": 0.15}
"""Activation ratio to no checkpointing when the transformer shape is unknown."""


@dataclass
class MemoryModel:
    """Predicts an experiment's peak device bytes."""

    shape: ModelShape
    activation_per_sample: int
    """Bytes the forward keeps per sample without checkpointing (measured)."""
    tokens_per_sample: int
    precision: str
    world_size: int
    device_memory: Optional[int]

    @classmethod
    def from_model_info(cls, info: Dict[str, Any], precision: str, world_size: int,
                        device_memory: Optional[int]) -> "MemoryModel":
        shape_info = dict(info.get("shape") or {})
        largest = int(shape_info.pop("largest_layer_params", 0) or 0)
        params = int(info["num_params"])
        shape = ModelShape(total_params=params, largest_layer_params=largest or params // 8,
                           **{k: v for k, v in shape_info.items() if k in ModelShape.__dataclass_fields__})
        per_sample = int(info.get("activation_mem_per_gpu", 0)) // max(int(info.get("micro_batch_size", 1)), 1)
        return cls(shape, per_sample, int(info.get("tokens_per_sample") or 0), precision,
                   world_size, device_memory)

    def _ac_ratio(self, policy: str) -> float:
        if policy == "none":
            return 1.0
        if self.shape.num_layers and self.shape.hidden_size and self.tokens_per_sample:
            mode = {"selective_ops": "selective"}.get(policy, policy)
            plain = estimate_activations(self.shape, 1, self.tokens_per_sample, self.precision, "none")
            kept: ActivationEstimate = estimate_activations(self.shape, 1, self.tokens_per_sample,
                                                            self.precision, mode)
            if plain.device:
                return kept.device / plain.device
        return FALLBACK_AC_RATIO.get(policy, 1.0)

    def predict(self, choice: Choice, micro_batch: int) -> int:
        """Peak device bytes of ``choice`` at ``micro_batch``."""
        none = ActivationEstimate(0, 0, "none")
        states = _row(self.shape, choice.stage, choice.offload_level, self.world_size, 1,
                      self.precision, none)
        act = self.activation_per_sample * micro_batch * self._ac_ratio(choice.ac)
        return int(states.device_total + act)

    def fits(self, choice: Choice, micro_batch: int) -> bool:
        """False only when the prediction is over ``SAFETY`` x the device memory."""
        if not self.device_memory:
            return True
        return self.predict(choice, micro_batch) <= SAFETY * self.device_memory
