"""benchmarks/zi_accuracy_bench.py: a smoke run (a few training steps) through every variant."""
import math

from tests.benchmarks._load import load_bench


def test_smoke_run_streams_the_trained_weights_and_prints_the_deltas(tmp_path, capsys):
    bench = load_bench("zi_accuracy_bench")
    out = tmp_path / "acc.json"
    assert bench.main(["--steps", "3", "--hidden", "64", "--intermediate", "128",
                       "--layers", "2", "--corpus-mb", "2", "--heldout-kb", "4",
                       "--out", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["plain", "zi", "zi_int8", "zi_int4"]
    for text in ("heldout", "fixed_text"):
        assert all(math.isfinite(r[text]) and r[text] > 1 for r in rows.values())
        # streaming without quantization is the plain forward
        assert abs(rows["zi"][text] / rows["plain"][text] - 1) < 1e-5
    # the quantized host copies cross the link in fewer bytes: int8 about 1/4 of fp32
    assert rows["zi_int4"]["bytes_per_pass"] < rows["zi_int8"]["bytes_per_pass"] \
        < 0.35 * rows["zi"]["bytes_per_pass"]
    assert rows["zi_int4"]["heldout"] != rows["plain"]["heldout"]
    printed = capsys.readouterr().out
    assert "zi_int4" in printed and "ppl heldout" in printed
