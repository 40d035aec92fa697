"""benchmarks/trace_gaps.py: per-stream busy time, copy rates and the compute stream's gaps
(with their cause: a late host launch or a dependency) from a Chrome trace."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_gaps as tg  # noqa: E402


def _dev(cat: str, ts: float, dur: float, stream: int, name: str, corr: int, **args) -> dict:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name,
            "args": {"stream": stream, "correlation": corr, **args}}


def _launch(ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "ts": ts, "dur": 5, "name": "cudaLaunchKernel",
            "tid": 1, "args": {"correlation": corr}}


def _host(ts: float, dur: float, name: str, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cpu_op", "ts": ts, "dur": dur, "name": name, "tid": tid}


TRACE = {"traceEvents": [
    {"ph": "X", "cat": "user_annotation", "ts": 0, "dur": 3000, "name": "phase: micro 0 forward"},
    {"ph": "X", "cat": "user_annotation", "ts": 3000, "dur": 4000, "name": "phase: micro 0 step"},
    _launch(0, 1), _dev("kernel", 10, 990, 7, "gemm_a", 1),            # busy 10..1000
    _launch(20, 2), _dev("kernel", 2000, 500, 7, "gemm_b", 2),         # gap 1000 us: waited
    _launch(4000, 3), _dev("kernel", 4100, 400, 7, "gemm_c", 3),       # gap 1600 us: host late
    _launch(30, 4), _dev("kernel", 4500, 100, 7, "tiny", 4),           # no gap (adjacent)
    _dev("gpu_memcpy", 100, 1000, 9, "Memcpy HtoD", 5, bytes=50e6),  # 50 MB in 1 ms
    _dev("gpu_memcpy", 600, 1000, 9, "Memcpy HtoD", 6, bytes=50e6),  # overlaps: busy 1.5 ms
    {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 10, "name": "aten::mm"},  # not device work
    _host(2000, 2050, "engine_step"), _host(2600, 1350, "aten::item"),  # cover 2500..4100
    _host(2600, 1400, "aten::copy_", tid=2),  # another thread: not the launching one
]}


def test_stream_busy_time_is_the_union_of_its_events_and_copies_report_their_rate() -> None:
    streams = tg.streams_of(TRACE)
    assert set(streams) == {7, 9}
    assert streams[7].busy_us() == 990 + 500 + 400 + 100
    assert streams[7].kernel_us() == 1990
    assert streams[9].busy_us() == 1500 and streams[9].copy_bytes == 100e6
    report = tg.summarize(TRACE)
    row9 = next(line for line in report.splitlines() if line.split()[:1] == ["9"])
    assert row9.split()[-1] == "66.7"  # 0.1 GB in 1.5 ms of busy time


def test_gaps_are_ranked_and_told_apart_by_when_the_kernel_was_launched() -> None:
    report = tg.summarize(TRACE, min_gap_us=200)
    lines = report.splitlines()
    summary = next(line for line in lines if line.startswith("compute stream 7"))
    assert "2 gaps >= 0.2 ms hold 2.6 ms, 1.6 of it host late" in summary
    first, second = [line for line in lines if "->" in line and "cause" not in line]
    assert "1.60  host late" in first and "micro 0 step / gemm_b -> gemm_c" in first
    assert first.endswith("/ aten::item (1.4 ms)")  # the innermost op covering the gap
    assert "1.00  waited" in second and "micro 0 forward / gemm_a -> gemm_b" in second
    assert second.endswith("/ -")  # the host ran no op then
    # summed by phase kind (micro index dropped), biggest first
    table = lines[lines.index(next(line for line in lines if "host late ms" in line)) + 1:][:2]
    assert [row.split() for row in table] == [["step", "1.6", "0.0"], ["forward", "0.0", "1.0"]]


def test_a_trace_without_device_events_says_so() -> None:
    assert tg.summarize({"traceEvents": [TRACE["traceEvents"][0]]}) == "no device events in the trace"
