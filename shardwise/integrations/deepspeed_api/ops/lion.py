"""``deepspeed.ops.lion``: ``FusedLion`` and ``DeepSpeedCPULion`` (shardwise's Lion)."""
from ....ops.lion import DeepSpeedCPULion, FusedLion  # noqa: F401

__all__ = ["DeepSpeedCPULion", "FusedLion"]
