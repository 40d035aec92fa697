"""The ``flops_profiler`` and ``comms_logger`` sections (DeepSpeed's keys and defaults)."""
from __future__ import annotations

from typing import Any, List, Optional

from pydantic import Field, field_validator

from shardwise.errors import ConfigError

from .base import ConfigModel


class FlopsProfilerConfig(ConfigModel):
    """``flops_profiler``: profile one training step's forward (shardwise.profiling)."""

    enabled: bool = False
    """Profile the step ``profile_step`` on global rank 0 and print (or write) the report."""
    recompute_fwd_factor: float = Field(0.0, ge=0.0)
    """Share of the forward that activation checkpointing recomputes in backward (0.0 none,
    1.0 all): backward flops = (2 + factor) x forward flops, fwd+bwd = (3 + factor) x."""
    profile_step: int = Field(1, ge=0)
    """The step to profile: the one whose ``global_steps`` (optimizer steps done before it)
    equals this number; 1 is the second step, after one step of warm-up."""
    module_depth: int = Field(-1, ge=-1)
    """Depths shown in the aggregated profile; -1: all."""
    top_modules: int = Field(1, ge=1)
    """Module classes listed per depth in the aggregated profile."""
    detailed: bool = True
    """Also print the module tree with every module's profile."""
    output_file: Optional[str] = None
    """Write the report to this file (parent folders are created) instead of stdout."""


class CommsLoggerConfig(ConfigModel):
    """``comms_logger``: time and size every collective (``shardwise.comm.log_summary()``)."""

    enabled: bool = False
    """Record each collective shardwise issues (each one then waits for completion, so the
    timing is real: leave this off outside of measurement runs)."""
    verbose: bool = False
    """Log every collective as it completes (rank 0)."""
    prof_all: bool = True
    """Record every collective; false: only the op names in ``prof_ops``."""
    prof_ops: List[str] = Field(default_factory=list)
    """Op names to record when ``prof_all`` is false ("all_reduce", "all_gather_into_tensor",
    "reduce_scatter_tensor", "broadcast", "all_gather", "barrier", ...)."""
    debug: bool = False
    """Append the calling function's name to each record's name."""

    @field_validator("prof_ops", mode="before")
    @classmethod
    def _op_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"comms_logger.prof_ops = {value!r} must be a list of op names, "
                              f"e.g. [\"all_reduce\", \"reduce_scatter_tensor\"]")
        return list(value)
