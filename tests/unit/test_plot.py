"""``shardwise plot``: PNGs from CSV and TensorBoard runs that decode and differ by metric,
``--compare`` overlays, and clear errors (no matplotlib, no run)."""
from __future__ import annotations

import math
import sys

import numpy as np

from shardwise.cli import main as cli_main
from shardwise.config.monitor import CSVConfig, TensorBoardConfig
from shardwise.monitor import CSVWriter, MonitorMaster, TensorBoardWriter

ALL = {"loss", "lr", "throughput", "memory", "loss_scale", "grad_norm", "overview"}


def _events(scale: float = 1.0):
    ev = []
    for k in range(1, 21):
        x = 8 * k
        ev += [("Train/Samples/train_loss", scale * 5 * math.exp(-k / 8), x),
               ("Train/Samples/lr", 1e-3 * min(1.0, k / 5), x),
               ("Train/Samples/loss_scale", 2.0 ** (16 - (k > 10)), x),
               ("Train/Samples/global_grad_norm", 1.0 / k, x)]
        if k % 5 == 0:
            ev += [("Train/Samples/samples_per_sec", 100.0 + k, x),
                   ("Train/Samples/tokens_per_sec", 800.0 + 8 * k, x),
                   ("Train/Samples/gpu_peak_memory_gib", 3.5, x),
                   ("Train/Samples/host_rss_gib", 1.0 + k / 100, x)]
    return ev


def _write_run(writer_cls, config_cls, root, job, scale=1.0):
    monitor = MonitorMaster([writer_cls(config_cls(enabled=True, output_path=str(root),
                                                   job_name=job))], enabled=True)
    monitor.write_events(_events(scale))
    monitor.close()
    return root / job


def _png(path):
    import matplotlib  # noqa: F401  (a test dependency: missing fails)
    import matplotlib.image
    assert path.stat().st_size > 1000
    return matplotlib.image.imread(str(path))


def test_plot_csv_run_writes_decodable_distinct_pngs(tmp_path, capsys) -> None:
    import matplotlib  # noqa: F401  (a test dependency: missing fails)
    run = _write_run(CSVWriter, CSVConfig, tmp_path, "job")
    assert cli_main(["plot", str(run)]) == 0
    out = run / "plots"
    assert {p.stem for p in out.glob("*.png")} == ALL
    images = {name: _png(out / f"{name}.png") for name in ALL}
    assert all(img.ndim == 3 and img.shape[0] > 100 and img.std() > 0 for img in images.values())
    assert not np.array_equal(images["loss"], images["lr"])
    assert not np.array_equal(images["throughput"], images["memory"])
    assert images["overview"].shape[0] > images["loss"].shape[0]
    assert str(out / "loss.png") in capsys.readouterr().out


def test_plot_tensorboard_run_and_compare(tmp_path) -> None:
    import matplotlib  # noqa: F401  (a test dependency: missing fails)
    import tensorboard  # noqa: F401  (a test dependency: missing fails)
    tb = _write_run(TensorBoardWriter, TensorBoardConfig, tmp_path / "tb", "a")
    other = _write_run(CSVWriter, CSVConfig, tmp_path / "csv", "b", scale=2.0)
    single, both = tmp_path / "single", tmp_path / "both"
    # the output_path folder (one job inside) is accepted as well as the job folder
    assert cli_main(["plot", str(tmp_path / "tb"), "--out", str(single)]) == 0
    assert cli_main(["plot", str(tb), "--out", str(both), "--compare", str(other)]) == 0
    assert {p.stem for p in single.glob("*.png")} == ALL
    assert not np.array_equal(_png(single / "loss.png"), _png(both / "loss.png"))


def test_plot_errors_are_clear(tmp_path, monkeypatch, capsys) -> None:
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli_main(["plot", str(tmp_path)]) == 2
    assert "no CSV monitor files" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli_main(["plot", str(tmp_path)]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
