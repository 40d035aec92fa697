"""The four monitor back ends. Each takes resolved ``(tag, float, step)`` events; the
``MonitorMaster`` buffers and calls them on global rank 0 only.

The optional packages are imported by ``require_package`` when the engine is built, so a
missing one is a clear error at ``initialize()``, not an ImportError mid-run.
"""
from __future__ import annotations

import csv
import importlib
from pathlib import Path
from typing import Any, Dict, List, Protocol, Tuple

from ..config.monitor import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from ..errors import ConfigError
from .events import csv_file_name, csv_header

Resolved = List[Tuple[str, float, int]]

#: section -> (module to import, pip requirement)
PACKAGES: Dict[str, Tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml>=3.41.0"),
}


def require_package(section: str) -> Any:
    """Import the package a monitor section needs, or raise ConfigError naming the install."""
    module, requirement = PACKAGES[section]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"\"{section}\": {{\"enabled\": true}} needs the '{module}' package, "
                          f"which cannot be imported ({err}). Install it with "
                          f"`pip install \"{requirement}\"` (or `pip install shardwise[monitor]`), "
                          f"or set \"{section}\": {{\"enabled\": false}}.") from None


def job_dir(output_path: str, job_name: str) -> Path:
    """``output_path/job_name`` as DeepSpeed lays it out ("" output_path: the working dir)."""
    return Path(output_path or ".") / job_name


class Writer(Protocol):
    def write(self, events: Resolved) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class CSVWriter:
    """One file per tag, header ``step,<last tag part>``, one row per event (DeepSpeed's layout).
    A file that already has rows (a resumed run) is appended to without a second header."""

    def __init__(self, config: CSVConfig) -> None:
        self.log_dir = job_dir(config.output_path, config.job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._started: set = set()

    def write(self, events: Resolved) -> None:
        rows: Dict[str, List[Tuple[int, float]]] = {}
        for tag, value, step in events:
            rows.setdefault(tag, []).append((step, value))
        for tag, tag_rows in rows.items():
            path = self.log_dir / csv_file_name(tag)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if tag not in self._started:
                    self._started.add(tag)
                    if f.tell() == 0:
                        writer.writerow(["step", csv_header(tag)])
                writer.writerows(tag_rows)

    def flush(self) -> None:
        """Every write closes its files: nothing is held open."""

    def close(self) -> None:
        """Nothing to release."""


class TensorBoardWriter:
    """``torch.utils.tensorboard.SummaryWriter`` under ``output_path/job_name``."""

    def __init__(self, config: TensorBoardConfig) -> None:
        require_package("tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = job_dir(config.output_path, config.job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, events: Resolved) -> None:
        for tag, value, step in events:
            self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """``wandb.init(project, group, entity=team)`` and one ``wandb.log`` per step's events."""

    def __init__(self, config: WandbConfig) -> None:
        self._wandb = require_package("wandb")
        try:
            self._run = self._wandb.init(project=config.project, group=config.group,
                                         entity=config.team)
        except Exception as err:  # no login, no network: say what to do, at initialize
            raise ConfigError(f"\"wandb\": wandb.init(project={config.project!r}, "
                              f"group={config.group!r}, entity={config.team!r}) failed: {err}. "
                              f"Log in with `wandb login` (or set WANDB_API_KEY), or run "
                              f"offline with WANDB_MODE=offline.") from err
        self._last_step = -1

    def write(self, events: Resolved) -> None:
        by_step: Dict[int, Dict[str, float]] = {}
        for tag, value, step in events:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            if step >= self._last_step:  # DeepSpeed's x axis: wandb's step = global samples
                self._run.log(by_step[step], step=step)
                self._last_step = step
            else:  # wandb drops a step older than its last one: keep the value, step as a column
                self._run.log({**by_step[step], "step": step})

    def flush(self) -> None:
        """wandb sends in the background."""

    def close(self) -> None:
        self._run.finish()


class CometWriter:
    """``comet_ml.start(...)``; a tag is logged again after ``samples_log_interval`` samples."""

    def __init__(self, config: CometConfig) -> None:
        comet_ml = require_package("comet")
        try:
            self.experiment = comet_ml.start(
                api_key=config.api_key, project=config.project, workspace=config.workspace,
                experiment_key=config.experiment_key, mode=config.mode, online=config.online)
        except Exception as err:  # no API key, no network: say what to do, at initialize
            raise ConfigError(f"\"comet\": comet_ml.start(project={config.project!r}, "
                              f"online={config.online!r}) failed: {err}. Set \"api_key\" (or "
                              f"COMET_API_KEY), or log offline with \"online\": false.") from err
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self.interval = int(config.samples_log_interval)
        self._last: Dict[str, int] = {}

    def _due(self, tag: str, step: int) -> bool:
        last = self._last.get(tag)
        if last is None or step - last >= self.interval:
            self._last[tag] = step
            return True
        return False

    def write(self, events: Resolved) -> None:
        for tag, value, step in events:
            if self._due(tag, step):
                self.experiment.log_metric(tag, value, step=step)

    def flush(self) -> None:
        """Comet sends (or archives) in the background."""

    def close(self) -> None:
        self.experiment.end()


def build_writers(tensorboard: TensorBoardConfig, csv_monitor: CSVConfig, wandb: WandbConfig,
                  comet: CometConfig, rank: int) -> List[Writer]:
    """The enabled writers: packages are checked on every rank (every rank fails alike),
    files and runs are created on global rank 0 only."""
    for name, section in (("tensorboard", tensorboard), ("wandb", wandb), ("comet", comet)):
        if section.enabled:
            require_package(name)
    if rank != 0:
        return []
    writers: List[Writer] = []
    if tensorboard.enabled:
        writers.append(TensorBoardWriter(tensorboard))
    if csv_monitor.enabled:
        writers.append(CSVWriter(csv_monitor))
    if wandb.enabled:
        writers.append(WandbWriter(wandb))
    if comet.enabled:
        writers.append(CometWriter(comet))
    return writers


__all__ = ["build_writers", "require_package", "CSVWriter", "TensorBoardWriter", "WandbWriter",
           "CometWriter", "Writer", "job_dir"]
