"""ZeRO stage 3: partitioned parameters gathered per module (see ``strategy.py``)."""
from .params import Stage3Params
from .strategy import Stage3Strategy

__all__ = ["Stage3Params", "Stage3Strategy"]
