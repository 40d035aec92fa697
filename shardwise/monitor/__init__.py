"""Monitors: DeepSpeed's ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` sections,
``engine.monitor.write_events(...)``, the ``wall_clock_breakdown`` timers, and ``shardwise plot``.

See docs/monitor.md for the tags, the file layout and the plots.
"""
from .events import DeviceScalar, Event, csv_file_name, csv_header
from .master import MonitorMaster
from .timers import GLOBAL_TIMERS, MICRO_TIMERS, EngineTimers
from .writers import (CometWriter, CSVWriter, TensorBoardWriter, WandbWriter, build_writers,
                      require_package)

__all__ = ["MonitorMaster", "EngineTimers", "GLOBAL_TIMERS", "MICRO_TIMERS", "DeviceScalar",
           "Event", "csv_file_name", "csv_header", "build_writers", "require_package",
           "CSVWriter", "TensorBoardWriter", "WandbWriter", "CometWriter"]
