"""benchmarks/zero_inference_bench.py: the tables and the PCIe-bound arithmetic (no GPU)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("zero_inference_bench",
                                                  ROOT / "benchmarks" / "zero_inference_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_quick_mode_fits_the_issue_shape():
    bench = _bench()
    args = bench.QUICK
    assert args["sizes"] == "7b" and "sw_cpu_bf16" in args["variants"] and "ds_z3" in args["variants"]
    assert set(bench.VARIANTS) >= set(args["variants"].split(","))
