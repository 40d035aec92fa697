"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` (torch's fused kernels)."""
from ....ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
