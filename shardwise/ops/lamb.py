"""``FusedLamb``: shardwise's foreach Lamb under DeepSpeed's name."""
from ..optim.lamb import Lamb as FusedLamb

__all__ = ["FusedLamb"]
