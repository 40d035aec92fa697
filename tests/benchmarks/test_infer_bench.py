"""benchmarks/infer_bench.py: the ratio table and the row bookkeeping (no GPU, no subprocess)."""
from pathlib import Path

from tests.benchmarks._load import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench('infer_bench')


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


def test_presets_parse_and_fit_their_budget_roughly():
    bench = _bench()
    for name, units in bench.PRESETS.items():
        for unit in units:
            bench.parse_unit(unit)
        if any("ds_inject" in u for u in units):  # last: it may JIT-build DeepSpeed's ops first
            assert "ds_inject" in units[-1]
        total = sum(bench.estimate_s(u) for u in units if "ds_inject" not in u)
        assert total < 600, (name, total)  # one device call; the tail is cut by --budget if slow
    covered = {(s, v, b) for units in bench.PRESETS.values() for u in units
               for s, vs, bs in [bench.parse_unit(u)] for v in vs for b in bs}
    assert ("1.1b", "ds_inject", 1) in covered and ("7b", "ds_inject", 1) in covered
    assert ("1.1b", "hf_eager", 1) in covered and ("7b", "sw_eager", 1) in covered
    for size in ("1.1b", "7b"):  # the comparisons at every batch size
        for batch in (1, 8, 32):
            assert {(size, "sw_inject", batch), (size, "hf_static", batch)} <= covered
    assert ("7b", "sw_int8", 1) in covered and ("7b", "ds", 1) in covered


def test_a_cut_off_unit_keeps_its_rows(monkeypatch):
    import argparse
    import json
    import subprocess
    bench = _bench()
    done = {"size": "7b", "variant": "sw_inject", "batch": 1, "tok_s": 230.0}

    def fake_run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, 5, output=("ROW " + json.dumps(done) + "\nnoise\n").encode())
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = argparse.Namespace(prompt=512, new=128, device="cuda", repeats=2, decode="")
    rows = bench.run_unit_process("7b:sw_inject:1,8", args, timeout=5)
    assert rows[0] == done
    assert rows[1]["batch"] == 8 and "timeout 5 s" in rows[1]["error"]


def test_units_past_the_budget_are_skipped_and_listed(tmp_path, capsys):
    import json
    bench = _bench()
    out = tmp_path / "rows.json"
    assert bench.main(["--units", "7b:hf_static:1", "--budget", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["variant"] == "hf_static" and rows[0]["error"].startswith("skipped")
    assert "FAILED: skipped" in capsys.readouterr().out


def test_targets_say_met_or_not():
    bench = _bench()
    row = {"size": "7b", "batch": 1, "ms_per_token": 1.0, "prefill_ms": 1.0, "cold_start_s": 50.0}
    rows = [dict(row, variant="sw_inject", tok_s=240.0, hbm_fraction=0.77, first_token_ms=20.0),
            dict(row, variant="hf_static", tok_s=156.0), dict(row, variant="sw_int8", tok_s=360.0)]
    lines = "\n".join(bench.target_lines(rows))
    assert "7b inject B=1 HBM fraction >= 75%" in lines and "77.0%  met" in lines
    assert "1.54x  met" in lines  # vs HF static
    assert "1.50x  NOT met" in lines  # int8 over bf16 (target 1.6x)
    assert "50.0  met (first token 20.0 ms once warm)" in lines


def test_a_unit_measures_each_variant_and_batch_on_cpu(capsys):
    import argparse
    import json
    bench = _bench()
    import os
    args = argparse.Namespace(prompt=8, new=3, device="cpu", repeats=1, decode="")
    saved = dict(os.environ)  # the unit sets RANK/WORLD_SIZE defaults for DeepSpeed
    try:
        bench.run_unit("tiny", ["hf_eager", "sw_inject"], [1, 2], args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    rows = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines() if line.startswith("ROW ")]
    assert [(r["variant"], r["batch"]) for r in rows] == [("hf_eager", 1), ("hf_eager", 2),
                                                          ("sw_inject", 1), ("sw_inject", 2)]
    assert all(r["tok_s"] > 0 and r["cold_start_s"] > 0 and "error" not in r for r in rows)


def test_a_variant_takes_decode_options_after_an_at():
    bench = _bench()
    size, variants, batches = bench.parse_unit("7b:sw_inject@gemv=reduction/attention=split:1,8")
    assert (size, variants, batches) == ("7b", ["sw_inject@gemv=reduction/attention=split"], [1, 8])
    assert bench.base_variant(variants[0]) == "sw_inject"
    assert bench.variant_options(variants[0]) == "gemv=reduction+attention=split"
    assert bench.estimate_s("7b:sw_inject@attention=split:1") == bench.estimate_s("7b:sw_inject:1")
    for bad in ("7b:hf_static@attention=split:1", "7b:sw_inject@attention=flash:1"):
        try:
            bench.parse_unit(bad)
        except (SystemExit, ValueError) as exc:
            assert "attention" in str(exc) or "DecodeOptions" in str(exc)
        else:
            raise AssertionError(f"{bad} parsed")


def test_an_options_row_is_labelled_and_compared_with_the_default(capsys):
    import argparse
    import json
    import os
    bench = _bench()
    args = argparse.Namespace(prompt=8, new=3, device="cpu", repeats=1, decode="")
    saved = dict(os.environ)
    try:
        bench.run_unit("tiny", ["sw_inject", "sw_inject@attention=split"], [1], args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    rows = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines() if line.startswith("ROW ")]
    assert [r["variant"] for r in rows] == ["sw_inject", "sw_inject@attention=split"]
    assert "decode" not in rows[0] and rows[1]["decode"] == "attention=split"
    bench.print_tables(rows)
    out = capsys.readouterr().out
    assert "shardwise inject @attention=split" in out
    line = [ln for ln in out.splitlines() if "@attention=split" in ln and "x" in ln][0]
    assert line.split()[-1].endswith("x")  # its ratio to the default step's row


def test_merge_keeps_the_measured_row_of_a_unit_skipped_in_another_call():
    bench = _bench()
    skipped = {"size": "7b", "variant": "sw_int8", "batch": 1, "error": "skipped: 78 s left"}
    measured = {"size": "7b", "variant": "sw_int8", "batch": 1, "tok_s": 222.0}
    other = {"size": "7b", "variant": "sw_inject", "batch": 1, "tok_s": 180.6}
    for order in ([[skipped, other], [measured]], [[measured], [skipped, other]]):
        rows = bench.merge_saved(order)
        assert sorted((r["variant"], "error" in r) for r in rows) == [("sw_inject", False),
                                                                      ("sw_int8", False)]
    late_error = dict(skipped, error="timeout")
    assert bench.merge_saved([[skipped], [late_error]]) == [late_error]
