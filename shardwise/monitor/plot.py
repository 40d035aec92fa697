"""``shardwise plot RUN_DIR [--out DIR] [--compare RUN_DIR2 ...]``: PNG plots of a monitor run.

One figure per metric (loss, learning rate, throughput, MFU, memory, loss scale, grad norm,
phase times) and an overview with all of them, over global samples (the monitors' x axis).
``--compare`` overlays other runs on every figure. Needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import ShardwiseError
from .run_reader import Run, read_run


@dataclass(frozen=True)
class Panel:
    """One figure: a title, a y label, and the series keys (CSV stems) it draws."""

    name: str
    title: str
    ylabel: str
    keys: Tuple[str, ...]
    log_y: bool = False


PANELS: Tuple[Panel, ...] = (
    Panel("loss", "Training loss", "loss", ("Train_Samples_train_loss", "Train_Samples_eval_loss")),
    Panel("lr", "Learning rate", "lr", ("Train_Samples_lr",)),
    Panel("throughput", "Throughput", "per second",
          ("Train_Samples_samples_per_sec", "Train_Samples_tokens_per_sec")),
    Panel("mfu", "Model FLOPs utilisation", "fraction of peak", ("Train_Samples_mfu",)),
    Panel("memory", "Memory", "GiB", ("Train_Samples_gpu_peak_memory_gib", "Train_Samples_host_rss_gib")),
    Panel("loss_scale", "fp16 loss scale", "loss scale", ("Train_Samples_loss_scale",), log_y=True),
    Panel("grad_norm", "Global gradient norm", "norm", ("Train_Samples_global_grad_norm",)),
    Panel("time", "Phase times per step (wall_clock_breakdown)", "ms",
          tuple(f"Train_Samples_elapsed_time_ms_{p}" for p in
                ("forward", "backward", "backward_inner", "backward_allreduce", "step"))),
)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ShardwiseError("shardwise plot needs matplotlib: `pip install matplotlib` "
                             "(or `pip install shardwise[monitor]`)") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def _draw(ax: Any, panel: Panel, runs: Sequence[Tuple[str, Run]]) -> bool:
    """Draw every series of ``panel`` from every run; False when none has data."""
    drew = False
    for label, run in runs:
        for key in panel.keys:
            series = run.get(key)
            if not series:
                continue
            xs, ys = zip(*series)
            name = key.replace("Train_Samples_", "")
            legend = name if len(runs) == 1 else f"{label}: {name}"
            marker = "o" if len(xs) < 30 else None
            ax.plot(xs, ys, label=legend, marker=marker, markersize=3)
            drew = True
    if drew:
        ax.set_title(panel.title)
        ax.set_xlabel("samples")
        ax.set_ylabel(panel.ylabel)
        if panel.log_y:
            ax.set_yscale("log", base=2)
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # 1.02 GiB, not 2e-2 + 1.0
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return drew


def plot_runs(runs: Sequence[Tuple[str, Run]], out: Path) -> List[Path]:
    """Write one PNG per panel with data, and ``overview.png``; returns the paths written."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    written, shown = [], []
    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        if _draw(ax, panel, runs):
            path = out / f"{panel.name}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            written.append(path)
            shown.append(panel)
        plt.close(fig)
    if shown:
        cols = 2 if len(shown) > 1 else 1
        rows = (len(shown) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.6 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, shown):
            _draw(ax, panel, runs)
        for ax in list(axes.flat)[len(shown):]:
            ax.axis("off")
        fig.suptitle(" vs ".join(label for label, _ in runs))
        fig.tight_layout()
        path = out / "overview.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path,
                   help="a monitor run: csv_monitor's (or tensorboard's) output_path/job_name")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default RUN_DIR/plots)")
    p.add_argument("--compare", type=Path, nargs="+", default=[], metavar="RUN_DIR2",
                   help="other runs to overlay")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    _pyplot()  # a missing matplotlib is reported before any file is read
    loaded = [read_run(run_dir) for run_dir in [args.run_dir, *args.compare]]
    names = [folder.name for folder, _ in loaded]
    unique = len(set(names)) == len(names)
    runs = [(folder.name if unique else str(folder), run) for folder, run in loaded]
    out = args.out or loaded[0][0] / "plots"
    written = plot_runs(runs, out)
    if not written:
        raise ShardwiseError(f"shardwise plot: none of the runs has a metric that plot knows "
                             f"({', '.join(p.name for p in PANELS)})")
    for path in written:
        print(path)
    return 0
