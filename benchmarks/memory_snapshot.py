"""What is allocated on the GPU at the moment of peak memory, grouped by where it was allocated.

``torch.cuda.memory._record_memory_history`` logs every allocation and free with its Python
stack; ``live_at_peak`` replays that log to the instant ``max_memory_allocated`` is reached and
returns the blocks alive then, ``summarize`` groups them by the first frame that is our code
(shardwise, transformers, the benchmark) rather than torch internals, so a table reads as
"4.1 GiB: shardwise/zero/flat_buckets.py:112 build_bucket".

Used by ``profile_step.py --memory-snapshot DIR``; the replay works on any snapshot dict, so
it is tested on CPU with a synthetic log.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

GIB = 1024**3

#: Path fragments of frames that say *who* allocated (checked in this order).
OWNER_MARKERS = ("shardwise", "transformers", "benchmarks", "deepspeed")


@dataclass
class LiveBlock:
    size: int
    frames: List[Dict[str, Any]]
    """Innermost first, as torch records them."""
    order: int
    """Index of the allocation in the trace (earlier = allocated earlier)."""


def start_recording(max_entries: int = 2_000_000) -> None:
    """Record every allocation and free from now on, with its Python stack."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def stop_recording() -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


def live_at_peak(trace: Sequence[Dict[str, Any]]) -> Tuple[int, int, List[LiveBlock]]:
    """``(peak bytes, index of the peak event, blocks live at that instant)`` of one device's
    trace. Only blocks allocated while recording are seen; a free of an unseen block is
    ignored."""
    live: Dict[int, LiveBlock] = {}
    total = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = LiveBlock(ev["size"], ev.get("frames") or [], i)
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action == "free_completed":
            block = live.pop(ev["addr"], None)
            if block is not None:
                total -= block.size
    # second pass: the live set at the peak (cheaper than copying it at every new maximum)
    live.clear()
    for i, ev in enumerate(trace[:peak_at + 1]):
        if ev.get("action") == "alloc":
            live[ev["addr"]] = LiveBlock(ev["size"], ev.get("frames") or [], i)
        elif ev.get("action") == "free_completed":
            live.pop(ev["addr"], None)
    return peak, peak_at, sorted(live.values(), key=lambda b: b.order)


def owner(frames: Sequence[Dict[str, Any]]) -> str:
    """``file:line function`` of the innermost frame from our code (else the innermost)."""
    for marker in OWNER_MARKERS:
        for f in frames:
            if marker in str(f.get("filename", "")):
                return _where(f)
    return _where(frames[0]) if frames else "<no stack>"


def _where(frame: Dict[str, Any]) -> str:
    name = str(frame.get("filename", "?"))
    for marker in OWNER_MARKERS:
        cut = name.rfind(marker + "/")
        if cut >= 0:
            name = name[cut:]
            break
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def summarize(trace: Sequence[Dict[str, Any]], top: int = 25) -> str:
    """A text table: the peak, the allocation that reached it, and the live bytes by owner."""
    peak, peak_at, blocks = live_at_peak(trace)
    groups: Dict[str, List[int]] = {}
    for b in blocks:
        groups.setdefault(owner(b.frames), []).append(b.size)
    lines = [f"peak allocated (recorded blocks): {peak / GIB:.2f} GiB at event {peak_at} of "
             f"{len(trace)}; {len(blocks)} blocks live"]
    if peak_at >= 0:
        stack = trace[peak_at].get("frames") or []
        lines.append("allocation that reached the peak:")
        lines += [f"    {_where(f)}" for f in stack[:12]]
    lines.append(f"{'GiB':>8} {'blocks':>7}  allocated at")
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    for where, sizes in ranked[:top]:
        lines.append(f"{sum(sizes) / GIB:8.3f} {len(sizes):7d}  {where}")
    rest = ranked[top:]
    if rest:
        lines.append(f"{sum(sum(s) for _, s in rest) / GIB:8.3f} {sum(len(s) for _, s in rest):7d}"
                     f"  ({len(rest)} other places)")
    return "\n".join(lines)
