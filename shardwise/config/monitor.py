"""The monitor sections: ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet``.

Key names and defaults are DeepSpeed's (``deepspeed/monitor/config.py``); ``shardwise.monitor``
builds the writers from them.
"""
from __future__ import annotations

from typing import Optional

from .base import ConfigModel

DEFAULT_JOB_NAME = "DeepSpeedJobName"


class TensorBoardConfig(ConfigModel):
    """``tensorboard``: scalar events in TensorBoard's format (needs ``pip install tensorboard``)."""

    enabled: bool = False
    """Write TensorBoard event files on global rank 0."""
    output_path: str = ""
    """Folder that holds the job folder; "" is the current working directory."""
    job_name: str = DEFAULT_JOB_NAME
    """Name of the run's folder inside ``output_path`` (events go to output_path/job_name)."""


class CSVConfig(ConfigModel):
    """``csv_monitor``: one CSV file per tag, ``output_path/job_name/<tag>.csv``."""

    enabled: bool = False
    """Write CSV files on global rank 0."""
    output_path: str = ""
    """Folder that holds the job folder; "" is the current working directory."""
    job_name: str = DEFAULT_JOB_NAME
    """Name of the run's folder inside ``output_path``."""


class WandbConfig(ConfigModel):
    """``wandb``: log to Weights & Biases (needs ``pip install wandb``; WANDB_MODE=offline works)."""

    enabled: bool = False
    """Log the events with ``wandb.log`` on global rank 0."""
    group: Optional[str] = None
    """W&B group that collects related runs."""
    team: Optional[str] = None
    """W&B entity (team or user) that owns the project."""
    project: str = "deepspeed"
    """W&B project name."""


class CometConfig(ConfigModel):
    """``comet``: log to Comet (needs ``pip install comet_ml``; ``"online": false`` stores the
    experiment in a local offline archive)."""

    enabled: bool = False
    """Log the events to a Comet experiment on global rank 0."""
    samples_log_interval: int = 100
    """A tag is sent again only after this many more global samples."""
    project: Optional[str] = None
    """Comet project (else COMET_PROJECT_NAME or .comet.config)."""
    workspace: Optional[str] = None
    """Comet workspace (else COMET_WORKSPACE or .comet.config)."""
    api_key: Optional[str] = None
    """Comet API key (else COMET_API_KEY or .comet.config)."""
    experiment_name: Optional[str] = None
    """Display name of the experiment."""
    experiment_key: Optional[str] = None
    """Key of an existing experiment to continue (32-50 alphanumeric characters)."""
    online: Optional[bool] = None
    """False: log to a local offline archive instead of the Comet server (default True)."""
    mode: Optional[str] = None
    """"get", "create" or "get_or_create" (Comet's default)."""
