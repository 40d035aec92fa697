"""The ``autotuning`` section: DeepSpeed's keys and defaults, plus ``trial_timeout`` (ours).

The engine reads ``enabled``, ``metric_path``, ``start_profile_step``/``end_profile_step``
and ``model_info`` (a trial run by the autotuner); the autotuner reads the rest.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional

from pydantic import Field, field_validator, model_validator

from .base import ConfigModel, lowered
from shardwise.errors import ConfigError

#: The environment variable a trial's workers get: where to write metrics.json. Either it or
#: ``autotuning.metric_path`` turns the engine probe on (with ``enabled``).
METRIC_PATH_ENV = "SHARDWISE_AUTOTUNING_METRIC_PATH"


class AutotuningConfig(ConfigModel):
    """``autotuning``: DeepSpeed's autotuner section (names and defaults as DeepSpeed's)."""

    enabled: bool = False
    """Run under the autotuner: with a metric path the engine times the profile steps, writes
    the metrics and exits after ``end_profile_step``."""
    fast: bool = True
    """DeepSpeed's meaning: tune the micro batch size per ZeRO stage only. Here: variants that
    only save memory (offload, activation checkpointing) are tried only where the plain
    variant of the same stage cannot run the smallest micro batch, and ``compile`` only on the
    best config found. False: every combination of the tuned keys goes to the tuner."""
    results_dir: str = "autotuning_results"
    """Where ds_config_optimal.json, cmd_optimal.txt and summary.txt go."""
    exps_dir: str = "autotuning_exps"
    """One folder per experiment (cmd.txt, ds_config.json, metrics.json, stdout.log, stderr.log)."""
    overwrite: bool = True
    """True: an experiment folder whose ds_config.json differs from the experiment's config is
    deleted and rerun. False: any finished folder of the same name is reused. Finished
    experiments with the same config are always reused (an interrupted tune resumes);
    DeepSpeed instead deletes exps_dir when this is true."""
    start_profile_step: int = Field(3, ge=0)
    """First optimizer step of the timed window (the steps before it warm up)."""
    end_profile_step: int = Field(5, ge=0)
    """Last timed optimizer step; the trial exits after it."""
    metric_path: Optional[str] = None
    """Where the engine writes the trial's metrics (set by the autotuner per experiment)."""
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """What the tuner maximises: samples/s, (minimises) seconds per step, or FLOPS per device."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Order of the experiments: the space in order, shuffled, or the next best predicted by a
    cost model fitted on the finished trials (see docs/autotuning.md)."""
    tuner_early_stopping: int = Field(5, ge=1)
    """Stop after this many experiments in a row without a better metric."""
    tuner_num_trials: int = Field(50, ge=1)
    """At most this many experiments (the profiling run not counted)."""
    arg_mappings: Optional[Dict[str, str]] = None
    """Config key -> script flag (e.g. "train_micro_batch_size_per_gpu": "--per_device_train_batch_size")
    whose value the trial command overwrites with the experiment's value."""
    max_train_batch_size: Optional[int] = Field(None, ge=1)
    """Upper bound of the global batch the micro batch search may reach."""
    min_train_batch_size: int = Field(1, ge=1)
    """Lower bound of the global batch."""
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1)
    """Largest micro batch tried."""
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1)
    """Smallest micro batch tried."""
    num_tuning_micro_batch_sizes: int = Field(3, ge=1)
    """Micro batch sizes measured per config: the largest that runs and the next smaller ones."""
    mp_size: int = Field(1, ge=1)
    """Model-parallel size (DeepSpeed's key; shardwise has no model parallelism, keep 1)."""
    model_info: Optional[Dict[str, Any]] = None
    """DeepSpeed's model_info: {"profile": true} makes a trial write model_info.json after its
    first forward and exit; "num_params", "hidden_size", "num_layers" may be given instead."""
    model_info_path: Optional[str] = None
    """Where the profiling trial writes model_info.json."""
    trial_timeout: float = Field(600.0, gt=0)
    """Ours: seconds one experiment may run before it is stopped and recorded as a timeout."""

    _lower = field_validator("metric", "tuner_type", mode="before")(
        classmethod(lambda cls, value: lowered(value)))

    @field_validator("arg_mappings", mode="before")
    @classmethod
    def _flags(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()):
            raise ConfigError(f"autotuning.arg_mappings = {value!r} must map config keys to "
                              f"script flags, e.g. {{\"train_micro_batch_size_per_gpu\": "
                              f"\"--per_device_train_batch_size\"}}")
        return value

    @model_validator(mode="after")
    def _ranges(self) -> "AutotuningConfig":
        if self.end_profile_step < self.start_profile_step:
            raise ConfigError(
                f"autotuning.end_profile_step = {self.end_profile_step} is before "
                f"start_profile_step = {self.start_profile_step}; the timed window is steps "
                f"start..end, e.g. \"start_profile_step\": 3, \"end_profile_step\": 5")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ConfigError(
                f"autotuning.max_train_micro_batch_size_per_gpu = "
                f"{self.max_train_micro_batch_size_per_gpu} is below "
                f"min_train_micro_batch_size_per_gpu = {self.min_train_micro_batch_size_per_gpu}; "
                f"raise the max or lower the min")
        if self.mp_size != 1:
            raise ConfigError(f"autotuning.mp_size = {self.mp_size}: shardwise has no model "
                              f"parallelism; remove the key or set it to 1")
        return self

    @property
    def profile_model_info(self) -> bool:
        """True when a trial should only measure the model (DeepSpeed's model_info.profile)."""
        return bool(self.model_info and self.model_info.get("profile", False))
