"""benchmarks/infer_bench.py: the ratio table and the row bookkeeping (no GPU, no subprocess)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("infer_bench", ROOT / "benchmarks" / "infer_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratio_table_compares_like_with_like(capsys):
    bench = _bench()
    base = {"size": "7b", "batch": 1, "ms_per_token": 1.0, "prefill_ms": 1.0, "cold_start_s": 1.0}
    rows = [dict(base, variant="hf_static", tok_s=100.0), dict(base, variant="sw_inject", tok_s=150.0),
            dict(base, variant="ds", batch=8, tok_s=10.0),
            {"size": "7b", "batch": 1, "variant": "ds_inject", "error": "Merging tensors is not allowed"}]
    assert bench.tok_s_ratio(rows, rows[1], "hf_static") == "1.50x"
    assert bench.tok_s_ratio(rows, rows[1], "ds") == "-"  # DeepSpeed row is at another batch size
    bench.print_tables(rows)
    out = capsys.readouterr().out
    assert "FAILED: Merging tensors" in out and "1.50x" in out
    assert set(bench.VARIANTS) == {"hf_eager", "hf_static", "ds", "ds_inject", "sw_eager",
                                   "sw_inject", "sw_int8"}


def test_merge_prints_one_table_from_saved_rows(tmp_path, capsys):
    import json
    bench = _bench()
    row = {"size": "1.1b", "batch": 1, "ms_per_token": 1.0, "prefill_ms": 1.0, "cold_start_s": 1.0}
    (tmp_path / "a.json").write_text(json.dumps([dict(row, variant="hf_static", tok_s=374.0)]))
    (tmp_path / "b.json").write_text(json.dumps([dict(row, variant="sw_inject", tok_s=794.8)]))
    assert bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "2.13x" in capsys.readouterr().out
