"""``shardwise report`` and the seed's Windows diagnostics, read from the real OS.

Under the Windows job the report must say Windows, gloo and no libuv store (Windows torch
wheels have none), and ``get_windows_specific_stats()`` must read the page file (psutil's
swap_memory on Windows is the page file) and the system cache (GetPerformanceInfo) for real.
"""
from __future__ import annotations

import json
import sys

import pytest

from tests.windows._helpers import ON_WINDOWS, UNDER_WINE, run_python

pytestmark = pytest.mark.windows


def test_report_json_says_windows_and_gloo() -> None:
    from shardwise.report import main, collect_report  # noqa: F401 - a rename must fail, not skip
    proc = run_python(["-m", "shardwise.report", "--json"], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    # Only the JSON document goes to stdout (warnings and c10d noise may precede it).
    text = proc.stdout[proc.stdout.index("{"):]
    report = json.loads(text[:text.rindex("}") + 1])
    comm = report["communication"]
    assert comm["gloo"] is True and comm["default_backend"] == "gloo"
    assert comm["nccl"] is False  # CPU-only job
    os_info = report["versions"]["os"]
    if ON_WINDOWS:
        assert os_info["system"] == "Windows"
        assert "Windows" in os_info["platform"]
        assert os_info.get("windows_build"), os_info  # e.g. 19045 (Wine says Windows 10)
        assert comm["libuv_store"] is False  # Windows wheels of torch are built without libuv
        assert report["versions"]["python_executable"].lower().endswith("python.exe")
    # The CLI word works too and prints the same sections as text.
    proc_text = run_python(["-m", "shardwise", "report", "--hide_operator_status"], timeout=180)
    assert proc_text.returncode == 0, proc_text.stdout[-3000:]
    assert "gloo" in proc_text.stdout
    if ON_WINDOWS:
        assert "Windows" in proc_text.stdout


def test_collect_report_in_process_matches_platform() -> None:
    import shardwise.report as report_mod
    report = report_mod.collect_report(include_ops=False)
    import platform
    assert report["versions"]["os"]["system"] == platform.system()
    if ON_WINDOWS:
        assert platform.system() == "Windows"
    assert report["versions"]["python"] == sys.version.split()[0]
    if ON_WINDOWS:
        assert not any("USE_LIBUV" in w for w in report.get("warnings", [])), report.get("warnings")


def test_windows_specific_stats_read_the_page_file_and_cache() -> None:
    import psutil
    import shardwise.utils as diag
    try:
        swap = psutil.swap_memory()
    except RuntimeError:
        # psutil reads the page file through performance counters; they can be disabled on
        # Windows, and Wine's pdh.dll has no "\\Paging File(_Total)\\% Usage" counter at all
        # (PdhAddEnglishCounterW fails). shardwise must still answer.
        swap = None
    stats = diag.get_windows_specific_stats()
    assert {"pagefile_usage", "system_cache", "labels", "platform"} <= set(stats)
    assert 0.0 <= stats["pagefile_usage"] <= 100.0
    label = stats["labels"]["pagefile_usage"]
    if swap is not None:
        # The same counter as psutil's (the page file on Windows), read now: within a few %.
        assert abs(stats["pagefile_usage"] - swap.percent) <= 5.0, (stats, swap)
    else:
        assert ON_WINDOWS, "psutil.swap_memory only fails this way on Windows"
        # The fallback: the commit charge, never 0 on a running system, and labelled as such.
        assert "commit" in label and stats["pagefile_usage"] > 0, stats
    if ON_WINDOWS:
        assert stats["platform"] == "windows"
        assert "page file" in label or "commit" in label, label
        # GetPerformanceInfo really answered (None would mean the call failed).
        assert stats["system_cache"] is not None, stats["labels"]
        assert "GetPerformanceInfo" in stats["labels"]["system_cache"]
        total_mb = psutil.virtual_memory().total / 2**20
        if UNDER_WINE:
            # Wine gap: GetPerformanceInfo leaves SystemCache at 0 (Wine 8.0).
            assert 0 <= stats["system_cache"] < total_mb, stats
        else:
            assert 0 < stats["system_cache"] < total_mb, stats
    mem = diag.get_memory_info()
    assert mem["cpu_total"] > 0 and 0 < mem["cpu_used"] <= mem["cpu_total"]
