"""ZeRO stage 3: partitioned parameters gathered per module (see ``strategy.py``)."""
from .strategy import Stage3Strategy

__all__ = ["Stage3Strategy"]
