"""The ``comms_logger``: time and size every collective shardwise issues.

Each collective in ``shardwise.comm`` goes through ``CommsLogger.run``: when the logger is
off (the default) that is one attribute test and the call itself. When it is on, the
accelerator is synchronised before the op, the op is made blocking (its work handle is
waited on and the accelerator synchronised again, as DeepSpeed does), and the latency and
message size are recorded under the op's name. ``log_summary()`` prints DeepSpeed's table:
per op and message size, the count, total and average latency, and the algorithmic and bus
bandwidth (nccl-tests' definitions, in Gbps).

Message size is the size of the op's main tensor argument, as DeepSpeed records it: the
tensor for all_reduce / broadcast, this rank's input for all_gather and
all_gather_into_tensor, the whole input (world x output) for reduce_scatter_tensor.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from ..utils.logging import log_dist

#: How the bandwidths follow from (message bytes, latency) for each op family.
_GATHER_LIKE = {"all_gather", "all_gather_into_tensor", "all_to_all_single"}
_SCATTER_LIKE = {"reduce_scatter", "reduce_scatter_tensor"}
_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}


def convert_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024, DeepSpeed's units)."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(names) - 1)
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def calc_bw_log(op: str, size: int, duration_ms: float, world: int) -> tuple:
    """(algorithmic bandwidth, bus bandwidth) in Gbps of one op.

    all_gather / all_gather_into_tensor: the whole output (world x message) moves, and
    (n-1)/n of it crosses the bus; reduce_scatter_tensor: the message already is the whole
    input; all_reduce: 2 x message algorithmically (DeepSpeed's convention), 2(n-1)/n on the
    bus; point-to-point, broadcast, reduce, barrier: message / time for both.
    """
    if duration_ms <= 0:
        return 0.0, 0.0
    n = max(int(world), 1)
    if op in _GATHER_LIKE:
        total = size * n if op != "all_to_all_single" else size
        algbw = total / duration_ms
        busbw = algbw * (n - 1) / n
    elif op in _SCATTER_LIKE:
        algbw = size / duration_ms
        busbw = algbw * (n - 1) / n
    elif op in _ALL_REDUCE:
        algbw = 2 * size / duration_ms
        busbw = size / duration_ms * 2 * (n - 1) / n
    else:
        algbw = busbw = size / duration_ms
    # bytes per millisecond -> gigabits per second
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(values: Sequence[float], trim: float = 0.1) -> float:
    """Mean after dropping ``trim`` of the values at each end (outliers)."""
    if not values:
        return 0.0
    data = sorted(values)
    k = int(round(len(data) * trim))
    kept = data[k:len(data) - k] or data
    return sum(kept) / len(kept)


@dataclass
class OpRecord:
    """Every call of one op name with one message size."""

    count: int = 0
    latencies_ms: List[float] = field(default_factory=list)
    algbw_gbps: List[float] = field(default_factory=list)
    busbw_gbps: List[float] = field(default_factory=list)


def _sync() -> None:
    from ..accelerator import get_accelerator
    get_accelerator().synchronize()


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _wait(handle: Any) -> None:
    if handle is not None and hasattr(handle, "wait"):
        handle.wait()


class CommsLogger:
    """The process's record of collectives (DeepSpeed's ``comms_logger``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: List[str] = []
        self.debug = False
        self.comms_dict: Dict[str, Dict[int, OpRecord]] = {}

    def configure(self, enabled: Optional[bool] = None, verbose: Optional[bool] = None,
                  prof_all: Optional[bool] = None, prof_ops: Optional[List[str]] = None,
                  debug: Optional[bool] = None) -> None:
        """Set the switches that are given (others keep their values)."""
        for name, value in (("enabled", enabled), ("verbose", verbose), ("prof_all", prof_all),
                            ("debug", debug)):
            if value is not None:
                setattr(self, name, bool(value))
        if prof_ops is not None:
            self.prof_ops = list(prof_ops)

    # --- recording ---------------------------------------------------------------------------
    def wants(self, name: str, prof: bool = False, log_name: Optional[str] = None) -> bool:
        """Whether a call of op ``name`` is recorded (``prof``: this call asks to be)."""
        return self.enabled and (prof or self.prof_all or name in self.prof_ops
                                 or (log_name is not None and log_name in self.prof_ops))

    def run(self, name: str, nbytes: int, fn: Callable[[], Any], group: Any = None,
            prof: bool = False, log_name: Optional[str] = None) -> Any:
        """Call ``fn()`` (a collective); when recording, time it to completion.

        Callers test ``enabled`` first, so a disabled logger never builds ``fn``."""
        if not self.wants(name, prof, log_name):
            return fn()
        record_name = log_name or name
        if self.debug:
            record_name = f"{record_name} | [Caller Func: {sys._getframe(2).f_code.co_name}]"
        _sync()
        t0 = time.perf_counter()
        handle = fn()
        _wait(handle)
        _sync()
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        self.append(name, record_name, elapsed_ms, int(nbytes), _group_size(group))
        return handle

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int,
               world: int) -> None:
        """Add one completed op."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, world)
        rec = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, OpRecord())
        rec.count += 1
        rec.latencies_ms.append(latency_ms)
        rec.algbw_gbps.append(algbw)
        rec.busbw_gbps.append(busbw)
        if self.verbose:
            log_dist(f"comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: "
                     f"{convert_size(msg_size)} | algbw (Gbps): {algbw:.2f} | busbw (Gbps): "
                     f"{busbw:.2f}", ranks=[0])

    # --- reading -----------------------------------------------------------------------------
    def reset_data(self) -> None:
        self.comms_dict.clear()

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def summary(self) -> Dict[str, Dict[int, Dict[str, Any]]]:
        """Per op name and message size: count, total/avg latency (ms), avg algbw/busbw (Gbps)."""
        out: Dict[str, Dict[int, Dict[str, Any]]] = {}
        for name, by_size in list(self.comms_dict.items()):
            out[name] = {}
            for size, rec in sorted(by_size.items()):
                out[name][size] = {
                    "count": rec.count, "total_latency_ms": sum(rec.latencies_ms),
                    "avg_latency_ms": trim_mean(rec.latencies_ms),
                    "tput_avg_gbps": trim_mean(rec.algbw_gbps),
                    "busbw_avg_gbps": trim_mean(rec.busbw_gbps),
                    "msg_size_bytes": size, "msg_size_str": convert_size(size)}
        return out

    def table(self) -> str:
        """DeepSpeed's summary table as text."""
        cols = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                "tput_avg (Gbps)", "busbw_avg (Gbps)")
        lines = ["".join(f"{c: <20}" for c in cols)]
        for name, by_size in self.summary().items():
            lines.append(name)
            for s in by_size.values():
                lines.append(f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}"
                             f"{s['total_latency_ms']: <20.2f}{s['avg_latency_ms']: <20.2f}"
                             f"{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}")
        return "\n".join(lines)


#: The process's logger: ``shardwise.comm`` records into it, ``log_summary()`` prints it.
COMMS_LOGGER = CommsLogger()
