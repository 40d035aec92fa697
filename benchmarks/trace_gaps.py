"""Where the GPU waited: per-stream busy time and the compute stream's idle gaps in a trace.

``torch.profiler`` writes a Chrome trace whose device events (kernels, copies, memsets) carry
the CUDA stream they ran on. A throughput loss that host-side timings cannot place shows up
here as idle time on the stream that runs the model, between two of its kernels; what the
host was doing then (the ``phase: ...`` markers ``profile_step.py`` records) says why.

    summary = summarize(json.load(open("trace.json")))

The compute stream is the one with the most kernel time. Each gap is reported with the
kernels on either side, the phase marker open on the host when the kernel after it was
launched, and a cause: "host late" when that launch came after the stream went idle (the
host, not the device, was the bottleneck), "waited" when the kernel was queued in time and
waited on a dependency (another stream's event, a copy).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class StreamStats:
    """Device work on one stream."""

    intervals: List[Tuple[float, float, str, str, int]] = field(default_factory=list)
    """(start us, end us, category, name, correlation id) of each event."""
    copy_bytes: float = 0.0

    def busy_us(self) -> float:
        return sum(hi - lo for lo, hi in _union([(iv[0], iv[1]) for iv in self.intervals]))

    def kernel_us(self) -> float:
        return sum(iv[1] - iv[0] for iv in self.intervals if iv[2] == "kernel")


def _union(spans: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def streams_of(trace: Dict[str, Any]) -> Dict[Any, StreamStats]:
    streams: Dict[Any, StreamStats] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in DEVICE_CATS:
            continue
        args = ev.get("args", {})
        st = streams.setdefault(args.get("stream", ev.get("tid")), StreamStats())
        start = float(ev["ts"])
        st.intervals.append((start, start + float(ev.get("dur", 0.0)), ev["cat"],
                             ev.get("name", ""), int(args.get("correlation", -1))))
        if ev["cat"] == "gpu_memcpy":
            st.copy_bytes += float(args.get("bytes", 0) or 0)
    return streams


def _phases(trace: Dict[str, Any]) -> List[Tuple[float, float, str]]:
    return sorted((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), ev["name"])
                  for ev in trace.get("traceEvents", [])
                  if ev.get("ph") == "X" and str(ev.get("name", "")).startswith("phase: ")
                  and ev.get("cat") not in DEVICE_CATS)


def _phase_at(phases: List[Tuple[float, float, str]], t: float) -> str:
    """The innermost (latest-starting) phase open at ``t``."""
    best = ""
    starts = [p[0] for p in phases]
    for lo, hi, name in phases[:bisect.bisect_right(starts, t)]:
        if lo <= t <= hi:
            best = name[len("phase: "):]
    return best or "-"


def summarize(trace: Dict[str, Any], top: int = 12, min_gap_us: float = 200.0) -> str:
    """A text report: every stream's busy time, copy volume and rate, then the compute
    stream's idle time and its ``top`` largest gaps of at least ``min_gap_us``."""
    streams = streams_of(trace)
    if not streams:
        return "no device events in the trace"
    lo = min(iv[0] for st in streams.values() for iv in st.intervals)
    hi = max(iv[1] for st in streams.values() for iv in st.intervals)
    window = hi - lo
    lines = [f"device window {window / 1e3:.1f} ms",
             f"{'stream':>8} {'events':>7} {'busy ms':>9} {'busy %':>7} {'kernel ms':>10} "
             f"{'copied GB':>10} {'GB/s busy':>10}"]
    for sid, st in sorted(streams.items(), key=lambda kv: -kv[1].busy_us()):
        busy = st.busy_us()
        rate = st.copy_bytes / 1e9 / (busy / 1e6) if st.copy_bytes and busy else 0.0
        lines.append(f"{str(sid):>8} {len(st.intervals):7d} {busy / 1e3:9.1f} "
                     f"{100 * busy / window:6.1f}% {st.kernel_us() / 1e3:10.1f} "
                     f"{st.copy_bytes / 1e9:10.2f} {rate:10.1f}")
    compute_id, compute = max(streams.items(), key=lambda kv: kv[1].kernel_us())
    events = sorted(compute.intervals)
    phases = _phases(trace)
    launched = _launch_times(trace)
    host = _host_ops(trace)
    gaps = []
    end, before = events[0][1], events[0][3]
    for a, b, _, name, corr in events[1:]:
        if a - end >= min_gap_us:
            # launched after the stream went idle: the host was late; before: the kernel
            # waited on a dependency (an event of another stream, a copy)
            launch, tid = launched.get(corr, (end, None))
            cause = "host late" if launch > end else "waited"
            gaps.append((a - end, end, before, name, cause, launch, tid, a))
        if b > end:
            end, before = b, name
    idle = window - compute.busy_us()
    late = sum(g[0] for g in gaps if g[4] == "host late")
    lines.append(f"compute stream {compute_id}: idle {idle / 1e3:.1f} ms of {window / 1e3:.1f} "
                 f"({100 * idle / window:.1f}%); {len(gaps)} gaps >= {min_gap_us / 1e3:.1f} ms "
                 f"hold {sum(g[0] for g in gaps) / 1e3:.1f} ms, {late / 1e3:.1f} of it host late")
    by_phase: Dict[str, Dict[str, float]] = {}
    for gap, _, _, _, cause, launch, _, _ in gaps:
        # "micro 2 backward" -> "backward": where in the step, summed over micro steps
        kind = _phase_at(phases, launch).split(" ")[-1]
        by_phase.setdefault(kind, {"host late": 0.0, "waited": 0.0})[cause] += gap
    if by_phase:
        lines.append(f"{'phase':>12} {'host late ms':>13} {'waited ms':>10}")
        for kind, causes in sorted(by_phase.items(), key=lambda kv: -sum(kv[1].values())):
            lines.append(f"{kind:>12} {causes['host late'] / 1e3:13.1f} {causes['waited'] / 1e3:10.1f}")
    if gaps:
        lines.append(f"{'at ms':>9} {'gap ms':>8}  {'cause':9}  phase that launched the next "
                     "kernel / kernel before -> after / host op covering the gap")
    for gap, at, before, after, cause, launch, tid, resumed in sorted(gaps, key=lambda g: -g[0])[:top]:
        culprit = _culprit(host.get(tid, []), at, resumed)  # only for the gaps printed
        lines.append(f"{(at - lo) / 1e3:9.1f} {gap / 1e3:8.2f}  {cause:9}  "
                     f"{_phase_at(phases, launch)} / {before[:40]} -> {after[:40]} / {culprit}")
    return "\n".join(lines)


def _launch_times(trace: Dict[str, Any]) -> Dict[int, Tuple[float, Any]]:
    """Correlation id -> (when the host call that enqueued the device event began, its
    thread)."""
    out: Dict[int, Tuple[float, Any]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = ev.get("args", {}).get("correlation")
            if corr is not None:
                out[int(corr)] = (float(ev["ts"]), ev.get("tid"))
    return out


def _host_ops(trace: Dict[str, Any]) -> Dict[Any, List[Tuple[float, float, str]]]:
    """Per host thread: (start, end, name) of its operator and runtime-call events."""
    out: Dict[Any, List[Tuple[float, float, str]]] = {}
    for ev in trace.get("traceEvents", []):
        if (ev.get("ph") == "X" and ev.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver",
                                                       "user_annotation")
                and not str(ev.get("name", "")).startswith("phase: ")):
            start = float(ev["ts"])
            out.setdefault(ev.get("tid"), []).append((start, start + float(ev.get("dur", 0.0)),
                                                      str(ev.get("name", ""))))
    return out


def _culprit(ops: List[Tuple[float, float, str]], lo: float, hi: float) -> str:
    """The innermost host op of the launching thread that covers most of [lo, hi]: what the
    host was busy with while the device waited ("-": no op, i.e. Python itself)."""
    need = 0.8 * (hi - lo)
    best = None
    for start, end, name in ops:
        if min(end, hi) - max(start, lo) >= need and (best is None or end - start < best[1] - best[0]):
            best = (start, end, name)
    return "-" if best is None else f"{best[2][:40]} ({(best[1] - best[0]) / 1e3:.1f} ms)"
