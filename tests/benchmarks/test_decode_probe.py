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


def test_probe_at_batch_above_one_counts_the_kv_cache_in_its_bound(capsys):
    probe = _probe()
    assert probe.main(["--device", "cpu", "--jobs", "tiny:base", "--batch", "3",
                       "--prompt", "10", "--new", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny:base" in out and "'error'" not in out, out[-2000:]
    # 3 x 14 positions x 2 layers x (K, V) x 2 KV heads x 16 dims x 2 bytes
    assert probe.kv_cache_bytes("tiny", 3, 14) == 3 * 14 * 2 * 2 * 2 * 16 * 2
    assert probe.kv_cache_bytes("7b", 16, 512) == 16 * 512 * 32 * 2 * 4096 * 2
