"""benchmarks/decode_probe.py on a tiny model on CPU: every job gives a row, bad options a clear row."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("decode_probe", ROOT / "benchmarks" / "decode_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_runs_jobs_and_names_a_bad_option(capsys):
    probe = _probe()
    assert probe.main(["--device", "cpu", "--jobs", "tiny:base,tiny:attention=split,tiny:gemm=x",
                       "--prompt", "12", "--new", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("(a) step ms"):]
    assert "tiny:base" in table and "tiny:attention=split" in table
    assert "unknown setting 'gemm'" in table
