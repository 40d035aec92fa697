"""Diagnostics: keys, units (MB = MiB, MB/s) and shardwise's own IO accounting."""
import logging
import sys
import time

import psutil
import pytest
import torch

from shardwise import utils
from shardwise.utils import diagnostics
from shardwise.utils.logging import logger

MiB = 2**20


def test_memory_info_keys_and_units():
    info = utils.get_memory_info()
    assert {"gpu_used", "gpu_total", "cpu_used", "cpu_total"} <= set(info)
    total = psutil.virtual_memory().total / MiB
    assert info["cpu_total"] == pytest.approx(total, abs=0.1)
    assert 0 < info["cpu_used"] <= info["cpu_total"]
    assert 0 < info["process_rss"] <= info["cpu_total"]
    if torch.cuda.is_available():
        assert info["gpu_total"] == pytest.approx(torch.cuda.mem_get_info()[1] / MiB, abs=0.1)
    elif not torch.backends.mps.is_available() and not torch.xpu.is_available():
        assert (info["gpu_device"], info["gpu_used"], info["gpu_total"]) == ("none", 0.0, 0.0)


def test_io_stats_count_own_io():
    utils.get_io_stats()  # start a fresh interval
    diagnostics.record_io(read_bytes=30 * MiB, write_bytes=10 * MiB)
    time.sleep(0.2)
    stats = utils.get_io_stats()
    assert {"read_speed", "write_speed", "shardwise_read_speed", "shardwise_write_speed",
            "interval_s", "source"} <= set(stats)
    assert stats["interval_s"] >= 0.2
    assert stats["shardwise_read_speed"] == pytest.approx(30 / stats["interval_s"], rel=0.05)
    assert stats["shardwise_write_speed"] == pytest.approx(10 / stats["interval_s"], rel=0.05)
    assert stats["read_speed"] >= 0 and stats["write_speed"] >= 0
    # The rates are "since the previous call": nothing recorded since, so zero now.
    assert utils.get_io_stats()["shardwise_write_speed"] == 0.0
    with pytest.raises(ValueError, match="read_bytes=-1"):
        diagnostics.record_io(read_bytes=-1)


def test_os_write_rate_sees_a_real_write(tmp_path):
    if diagnostics._os_io_counters()[2] != "disk":
        pytest.skip("no disk counters on this machine")
    utils.get_io_stats()
    before = diagnostics._os_io_counters()[1]
    path = tmp_path / "blob"
    with open(path, "wb") as f:
        f.write(b"\0" * (8 * MiB))
        f.flush()
        import os
        os.fsync(f.fileno())
    after = diagnostics._os_io_counters()[1]
    stats = utils.get_io_stats()
    expected = (after - before) / MiB / stats["interval_s"]
    assert stats["write_speed"] >= expected * 0.5 - 0.1


def test_platform_stats():
    stats = utils.get_platform_stats()
    assert utils.get_windows_specific_stats().keys() == stats.keys()
    assert {"pagefile_usage", "system_cache", "labels", "platform"} <= set(stats)
    assert 0.0 <= stats["pagefile_usage"] <= 100.0
    assert set(stats["labels"]) == {"pagefile_usage", "system_cache"}
    if sys.platform.startswith("linux"):
        vm = psutil.virtual_memory()
        # Another process may fill or drop the page cache between the two readings.
        assert stats["system_cache"] == pytest.approx((vm.cached + vm.buffers) / MiB, rel=0.25,
                                                      abs=256)
        assert "swap" in stats["labels"]["pagefile_usage"]


def test_platform_stats_without_swap_counters(monkeypatch):
    def broken():
        raise RuntimeError("PdhAddEnglishCounterW failed. Performance counters may be disabled.")

    monkeypatch.setattr(psutil, "swap_memory", broken)
    monkeypatch.setattr(diagnostics, "_windows_performance_info",
                        lambda: {"commit_total": 3 * MiB, "commit_limit": 12 * MiB,
                                 "system_cache": 5 * MiB})
    stats = utils.get_platform_stats()
    if sys.platform.startswith("win"):
        assert stats["pagefile_usage"] == 25.0 and stats["system_cache"] == 5.0
        assert "commit charge" in stats["labels"]["pagefile_usage"]
    else:
        assert stats["pagefile_usage"] == 0.0 and stats["swap_total"] == 0.0
        assert "unavailable" in stats["labels"]["pagefile_usage"]


def test_see_memory_usage_logs_at_rank_0():
    records = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Grab()
    logger.addHandler(handler)
    try:
        result = utils.see_memory_usage("after step 3")
        assert utils.see_memory_usage("quiet", force=False) == {}
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1 and "after step 3" in records[0] and "MB/s" in records[0]
    assert set(result) == {"memory", "io", "platform"}
