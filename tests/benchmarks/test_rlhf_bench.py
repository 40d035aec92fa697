"""benchmarks/rlhf_bench.py's tables: every variant's row, ratios of the hybrid engine last."""
from __future__ import annotations

from pathlib import Path

from tests.benchmarks._load import load_bench

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rlhf_bench.py"


def _bench():
    return load_bench('rlhf_bench')


def _row(variant, tok_s, switch=0.0):
    return {"size": "1.1b", "variant": variant, "batch": 16, "gen_tok_s": tok_s, "gen_s": 1.0,
            "train_s": 0.5, "switch_s": switch, "allgather_s": 0.02, "peak_gib": 10.0,
            "first_iter_s": 30.0}


def test_ratio_table_comes_last(capsys):
    rows = [_row("sw_hybrid", 3000.0, 0.03), _row("sw_zero3", 150.0),
            {"size": "1.1b", "variant": "ds_hybrid", "batch": 16, "error": "kernel build failed"}]
    _bench().print_tables(rows)
    out = capsys.readouterr().out.strip().splitlines()
    assert "FAILED: kernel build failed" in "\n".join(out)
    last = out[-1].split()
    assert last[:2] == ["1.1b", "16"] and last[-3:] == ["20.00x", "-", "1.50x"]


def test_decode_options_variant_has_its_own_row_and_ratio(capsys):
    bench = _bench()
    assert bench.base_variant("sw_hybrid@attention=reduction+gemv=reduction") == "sw_hybrid"
    rows = [_row("sw_hybrid", 3000.0, 0.03), _row("sw_hybrid@attention=reduction", 4500.0, 0.03),
            _row("sw_zero3", 150.0)]
    bench.print_tables(rows)
    out = capsys.readouterr().out.strip().splitlines()
    ratios = out[out.index(next(line for line in out if line.startswith("ratios:"))) + 1:]
    assert [line.split()[-3] for line in ratios] == ["20.00x", "30.00x"]
    assert "@attention=reduction" in ratios[1]


def test_children_get_an_arch_list_deepspeed_can_parse(monkeypatch):
    # DeepSpeed 0.19.8 died on the H200 image's "9.0a" (int('0a')) before building its kernels
    from _child_run import child_env
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0f+PTX")
    assert child_env()["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert "TORCH_CUDA_ARCH_LIST" not in child_env()


def test_generation_floor_counts_weights_and_the_written_cache():
    bench = _bench()
    shape = bench.SIZES["7b"]
    weights = bench.decode_bytes(shape, batch=16, visible=0)
    # the Llama-2-7B shape: 6.48e9 projection and head parameters in bf16 (embeddings left out)
    assert abs(weights / 2 - (32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) + 32000 * 4096)) < 1
    per_position = bench.decode_bytes(shape, 16, 1) - weights
    assert per_position == 16 * 32 * 2 * 4096 * 2  # K and V, every layer, every sequence
    # GQA: the 1.1B's 4 KV heads of 32 keep an eighth of the K/V width
    small = bench.SIZES["1.1b"]
    assert bench.decode_bytes(small, 1, 1) - bench.decode_bytes(small, 1, 0) == 22 * 2 * 256 * 2
    # 256 steps with 256 + 128.5 positions written on average, at 3 TB/s
    floor = bench.generation_floor_s(shape, 16, 256, 256, 3e12)
    assert abs(floor - 256 * (weights + 384.5 * per_position) / 3e12) < 1e-9


def test_floor_and_the_largest_possible_ratio_are_printed(capsys):
    rows = [dict(_row("sw_hybrid", 2000.0, 0.03), gen_s=2.0, floor_gen_s=1.5, copy_tb_s=3.0),
            dict(_row("sw_zero3", 400.0), gen_s=9.0)]
    _bench().print_tables(rows)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "floor 1.50 s" in x)
    assert "at 3.00 TB/s" in line and "75% of it" in line and "at most 6.00x" in line
