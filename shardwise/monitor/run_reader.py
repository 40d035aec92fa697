"""Read a monitor run back: the CSV monitor's files, or TensorBoard's event files.

A run is a dict ``{key: [(step, value), ...]}`` where the key is the CSV file's stem
(``Train_Samples_train_loss``); TensorBoard tags are turned into the same keys.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict, List, Tuple

from ..errors import ShardwiseError
from .events import csv_file_name

Series = List[Tuple[int, float]]
Run = Dict[str, Series]


def _has_data(folder: Path) -> bool:
    return any(folder.glob("*.csv")) or any(folder.glob("events.out.tfevents.*"))


def find_job_dir(run_dir: Path) -> Path:
    """``run_dir`` itself, or its only job folder (``output_path`` given instead of the job)."""
    if not run_dir.is_dir():
        raise ShardwiseError(f"shardwise plot: {run_dir} is not a folder; pass the monitor's "
                             f"output_path/job_name folder")
    if _has_data(run_dir):
        return run_dir
    jobs = sorted(d for d in run_dir.iterdir() if d.is_dir() and _has_data(d))
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise ShardwiseError(f"shardwise plot: no CSV monitor files (*.csv) or TensorBoard event "
                             f"files (events.out.tfevents.*) in {run_dir} or its sub-folders; "
                             f"enable \"csv_monitor\" or \"tensorboard\" in the config")
    raise ShardwiseError(f"shardwise plot: {run_dir} holds several runs "
                         f"({', '.join(j.name for j in jobs)}); pass one of them, and the others "
                         f"with --compare")


def read_csv_run(folder: Path) -> Run:
    run: Run = {}
    for path in sorted(folder.glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        series = []
        for row in rows[1:]:
            if len(row) != 2 or row[0] == "step":  # a second header from an appended run
                continue
            try:
                series.append((int(float(row[0])), float(row[1])))
            except ValueError:
                continue
        if series:
            run[path.stem] = series
    return run


def read_tensorboard_run(folder: Path) -> Run:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ShardwiseError(f"shardwise plot: {folder} has TensorBoard event files and no CSV "
                             f"files; reading them needs `pip install tensorboard`") from None
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {csv_file_name(tag)[:-4]: [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]
            for tag in acc.Tags().get("scalars", [])}


def read_run(run_dir: Path) -> Tuple[Path, Run]:
    """(the job folder, its series): CSV files when there are any, else TensorBoard's."""
    folder = find_job_dir(Path(run_dir))
    run = read_csv_run(folder) if any(folder.glob("*.csv")) else read_tensorboard_run(folder)
    if not run:
        raise ShardwiseError(f"shardwise plot: {folder} has monitor files but no values in them")
    return folder, run
