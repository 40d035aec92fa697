"""train_bench.py's NVMe variants end to end on a tiny CPU model: shardwise's ZeRO-2 and
ZeRO-3 with the optimizer states in swap files under --nvme-path train and agree with torch,
DeepSpeed's ds_z3_nvme reports why it cannot run as its row's error (no crash), and the swap
folders are gone when the run ends."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.test_train_bench import REPO, TINY


@pytest.mark.slow
def test_train_bench_nvme_variants_tiny_cpu(tmp_path: Path) -> None:
    out, swap = tmp_path / "bench.json", tmp_path / "swap"
    swap.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_bench.py"), *TINY,
         "--variants", "torch,sw_z2_nvme,sw_z3_nvme,ds_z3_nvme", "--nvme-path", str(swap),
         "--out", str(out), "--timeout", "150", "--loss-steps", "3"],
        capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("sw_z2_nvme", "sw_z3_nvme"):
        assert "error" not in rows[name], rows[name]
        assert abs(rows[name]["loss_last"] - rows["torch"]["loss_last"]) < 0.05
    assert rows["ds_z3_nvme"]["error"]  # DeepSpeed (or its async_io op) is not there
    assert "ds_z3_nvme  FAILED" in proc.stdout or "ds_z3_nvme" in proc.stdout
    assert not list(swap.glob("shardwise_swap/*"))


def test_deepspeed_aio_probe_keeps_the_stderr_descriptor(monkeypatch) -> None:
    """DeepSpeed's libaio probe (has_function) redirects ``sys.stderr.fileno()`` and answers
    "not compatible" on any exception; the benchmark once wrapped it in a StringIO stderr,
    which has no descriptor, and reported libaio missing on a machine that had it."""
    import types

    from tests.benchmarks._load import load_bench

    class FakeBuilder:  # DeepSpeed's AsyncIOBuilder, as far as the probe goes
        def is_compatible(self, verbose: bool = False) -> bool:
            try:
                sys.stderr.fileno()
            except Exception:
                return False
            return True

        def load(self) -> object:
            return object()

    op_builder = types.ModuleType("deepspeed.ops.op_builder")
    op_builder.AsyncIOBuilder = FakeBuilder
    for name, module in (("deepspeed", types.ModuleType("deepspeed")),
                         ("deepspeed.ops", types.ModuleType("deepspeed.ops")),
                         ("deepspeed.ops.op_builder", op_builder)):
        monkeypatch.setitem(sys.modules, name, module)
    assert load_bench("train_bench").deepspeed_aio_error() is None
