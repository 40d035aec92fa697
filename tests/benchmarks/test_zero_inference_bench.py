"""benchmarks/zero_inference_bench.py: the tables and the PCIe-bound arithmetic (no GPU)."""
from pathlib import Path

from tests.benchmarks._load import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench('zero_inference_bench')


def test_tables_ratios_and_auto_batch_label(capsys):
    bench = _bench()
    base = {"size": "7b", "batch": 1, "step_mb": 13000.0, "h2d_gbps": 55.0, "pcie_fraction": 0.9,
            "prefill_s": 0.5, "peak_gib": 20.0, "build_s": 30.0}
    rows = [dict(base, variant="sw_cpu_bf16", tok_s=3.8), dict(base, variant="ds_z3", tok_s=2.0),
            dict(base, variant="sw_cpu_int4", batch="auto", rows=200, tok_s=900.0),
            {"size": "7b", "batch": 1, "variant": "hf_accel", "error": "CUDA out of memory"}]
    assert bench.tok_s_ratio(rows, rows[0], "ds_z3") == "1.90x"
    bench.print_tables(rows)
    out = capsys.readouterr().out
    assert "FAILED: CUDA out of memory" in out and "1.90x" in out and "auto=200" in out


def test_issue22_plan_covers_the_targets_within_the_budget():
    bench = _bench()
    rows = bench.PLANS["issue22"]
    have = {(r.size, r.variant, r.batch) for r in rows}
    for need in [("7b", v, b) for v in ("sw_cpu_bf16", "sw_cpu_int8", "sw_cpu_int4") for b in (1, 16)] + \
            [("7b", "sw_nvme_bf16", 1), ("7b", "ds_z3", 1), ("7b", "hf_accel", 1),
             ("1.1b", "sw_cpu_bf16", 1), ("1.1b", "ds_z3", 1), ("70b", "sw_cpu_int4", 1),
             ("7b", "sw_cpu_bf16_kv", 64)]:
        assert need in have, need
    assert all(r.variant in bench.VARIANTS and r.size in bench.SIZES and r.new >= 2 for r in rows)
    total = sum(bench.estimate_s(r, bench.SIZES, 512) for r in rows)
    assert 200 < total < 540, total  # one ~9-minute device call


def test_budget_skips_rows_that_no_longer_fit_and_saves_after_each(tmp_path, monkeypatch):
    bench = _bench()
    calls = []

    def fake_child(args, row, timeout):
        calls.append((row, timeout))
        return {"size": row.size, "variant": row.variant, "batch": row.batch, "tok_s": 1.0,
                "step_mb": 1.0, "h2d_gbps": 50.0, "pcie_fraction": 0.9, "prefill_s": 0.1,
                "peak_gib": 1.0, "build_s": 1.0}
    monkeypatch.setattr(bench, "_child", fake_child)
    out = tmp_path / "rows.json"
    bench.main(["--plan", "issue22", "--budget-s", "60", "--out", str(out)])
    import json
    rows = json.loads(out.read_text())
    assert len(rows) == len(bench.PLANS["issue22"])
    ran = [r for r in rows if "tok_s" in r]
    assert ran and all("skipped" in r for r in rows if "tok_s" not in r)
    assert all(timeout <= 60 for _, timeout in calls)
    merged = tmp_path / "all.json"
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"size": "70b", "variant": "sw_cpu_int4", "batch": 1, "error": "x"}]))
    bench.main(["--merge", f"{out},{other}", "--out", str(merged)])
    assert len(json.loads(merged.read_text())) == len(rows)  # the 70b row replaced, not added


def test_nvme_row_measures_the_disk_through_the_streamer(tmp_path):
    """The 2026-12-06 issue22 call lost its NVMe row after generating: the bench read the swap
    files through an attribute the streamer no longer had. One tiny NVMe row on the CPU runs
    the same code: tokens, then the direct-read speed of the swap files, then the fraction."""
    import argparse
    import math

    import pytest
    bench = _bench()
    args = argparse.Namespace(
        mem_cap_gib=0.0, prompt=8, new=3, nvme_path=str(tmp_path), auto_cap=4)
    row = bench.measure(args, "tiny", "sw_nvme_bf16", 2)
    assert row["tok_s"] > 0 and row["rows"] == 2
    assert math.isfinite(row["disk_gbps"]) and row["disk_gbps"] > 0
    assert row["disk_fraction"] == pytest.approx(
        row["steps_s"] * row["step_mb"] * 1e6 / (row["disk_gbps"] * 1e9), rel=1e-9)
    assert not any(tmp_path.rglob("*.swp"))  # the streamer removed its swap files
