"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is shardwise's engine class."""
from ....runtime.engine import ShardwiseEngine as DeepSpeedEngine  # noqa: F401

__all__ = ["DeepSpeedEngine"]
