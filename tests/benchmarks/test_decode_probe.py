"""benchmarks/decode_probe.py on a tiny model on CPU: every job gives a row, bad options a clear row."""
from pathlib import Path

from tests.benchmarks._load import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _probe():
    return load_bench('decode_probe')


def test_probe_runs_jobs_and_names_a_bad_option(capsys):
    probe = _probe()
    assert probe.main(["--device", "cpu", "--jobs", "tiny:base,tiny:attention=split,tiny:gemm=x",
                       "--prompt", "12", "--new", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("(a) step ms"):]
    assert "tiny:base" in table and "tiny:attention=split" in table
    assert "unknown setting 'gemm'" in table
