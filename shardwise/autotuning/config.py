"""The ``autotuning`` section's model lives with the other sections (``shardwise/config/
autotuning.py``, so that loading a config never imports the tuner); re-exported here."""
from __future__ import annotations

from ..config.autotuning import METRIC_PATH_ENV, AutotuningConfig

__all__ = ["AutotuningConfig", "METRIC_PATH_ENV"]
