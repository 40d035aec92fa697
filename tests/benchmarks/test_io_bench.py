"""``shardwise io-bench`` / ``nvme-tune``: JSON output, ds_io aliases, the test file removed."""
from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.io.bench import parse_size
from shardwise.io.bench_cli import effective_gbps


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_io_bench_json_reports_both_directions_and_cleans_up(tmp_path, capsys):
    out = _json(capsys, ["io-bench", "--path", str(tmp_path), "--size", "2M", "--block-size", "256K",
                         "--queue-depth", "2", "--threads", "2", "--json"])
    for key in ("read_gbps", "write_gbps", "baseline_read_gbps", "baseline_write_gbps"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["verified"] is True and out["size_bytes"] == 2 << 20 and out["io_threads"] == 4
    assert out["read_vs_baseline"] == pytest.approx(out["read_gbps"] / out["baseline_read_gbps"], rel=1e-2)
    assert list(tmp_path.iterdir()) == []


def test_ds_io_flags_are_aliases(tmp_path, capsys):
    out = _json(capsys, ["io-bench", "--folder", str(tmp_path), "--io_size", "1000K", "--block_size",
                         "128K", "--queue_depth", "3", "--io_parallel", "1", "--read", "--loops", "2",
                         "--buffered", "--json"])
    assert out["write_gbps"] is None and out["read_gbps"] > 0 and out["direct"] is False
    assert out["block_size"] == 128 << 10 and out["queue_depth"] == 3 and out["loops"] == 2
    assert out["size_bytes"] == 1000 << 10  # already a multiple of 4 KiB
    assert len(out["samples"]["read"]) == 2 and list(tmp_path.iterdir()) == []


def test_nvme_tune_prints_an_aio_section_the_config_reads(tmp_path, capsys):
    out = _json(capsys, ["nvme-tune", "--path", str(tmp_path), "--size", "1M", "--block-sizes",
                         "64K,256K", "--queue-depths", "1,2", "--threads", "1", "--json"])
    assert len(out["results"]) == 4
    best = out["results"][0]
    assert best["effective_gbps"] == max(r["effective_gbps"] for r in out["results"])
    aio = out["aio"]
    assert (aio["block_size"], aio["queue_depth"], aio["intra_op_parallelism"]) == (
        best["block_size"], best["queue_depth"], best["intra_op_parallelism"])
    assert "thread_count" not in aio
    assert load_config({"train_batch_size": 1, "aio": aio}, world_size=1).aio.block_size == aio["block_size"]
    assert list(tmp_path.iterdir()) == []


def test_sizes_and_bad_flags(tmp_path, capsys):
    assert parse_size("1G", "--size") == 1 << 30 and parse_size("256KiB", "--size") == 256 << 10
    assert effective_gbps(1.0, 1.0) == pytest.approx(1.0) and effective_gbps(2.0, 1.0) == pytest.approx(4 / 3)
    assert main(["io-bench", "--path", str(tmp_path), "--size", "lots"]) == 2
    assert "--size 'lots' is not a size" in capsys.readouterr().err
