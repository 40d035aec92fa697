"""Memory, IO and platform statistics (the seed's section 5.2 "bwc" diagnostics).

Every size is in MB meaning MiB (2**20 bytes) and every rate in MB/s of MiB, as floats rounded
to 0.1. Sources: psutil for the OS, torch's own counters for the accelerator, and
``record_io`` for the bytes shardwise's checkpoint/offload code moved itself.

* ``get_memory_info()``: ``gpu_used``/``gpu_total`` (device-wide, all processes),
  ``gpu_allocated``/``gpu_reserved`` (this process's tensors / caching allocator),
  ``cpu_used``/``cpu_total`` (system-wide) and ``process_rss``.
* ``get_io_stats()``: disk ``read_speed``/``write_speed`` since the previous call, and
  ``shardwise_read_speed``/``shardwise_write_speed`` for shardwise's own IO.
* ``get_platform_stats()`` (seed name ``get_windows_specific_stats``): ``pagefile_usage`` (%)
  and ``system_cache`` (MB) — the page file and system file cache on Windows, swap and the
  page cache (cached + buffers) on Linux — with ``labels`` saying which.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Dict, Optional

import psutil

MB = float(2**20)

_lock = threading.Lock()
_own_io = {"read": 0, "write": 0}


def record_io(read_bytes: int = 0, write_bytes: int = 0) -> None:
    """Count bytes shardwise read/wrote itself (checkpoint and offload code call this)."""
    if read_bytes < 0 or write_bytes < 0:
        raise ValueError(f"record_io takes byte counts >= 0, got read_bytes={read_bytes}, "
                         f"write_bytes={write_bytes}")
    with _lock:
        _own_io["read"] += int(read_bytes)
        _own_io["write"] += int(write_bytes)


def _mb(value: float) -> float:
    return round(value / MB, 1)


def get_memory_info() -> Dict[str, Any]:
    """Accelerator and host memory in MB (see the module docstring for each key)."""
    import torch
    vm = psutil.virtual_memory()
    info: Dict[str, Any] = {"gpu_used": 0.0, "gpu_total": 0.0, "gpu_allocated": 0.0,
                            "gpu_reserved": 0.0, "gpu_device": "none",
                            "cpu_used": _mb(vm.total - vm.available), "cpu_total": _mb(vm.total),
                            "process_rss": _mb(psutil.Process().memory_info().rss)}
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        info.update(gpu_used=_mb(total - free), gpu_total=_mb(total),
                    gpu_allocated=_mb(torch.cuda.memory_allocated(index)),
                    gpu_reserved=_mb(torch.cuda.memory_reserved(index)),
                    gpu_device=f"cuda:{index}")
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        index = torch.xpu.current_device()
        total = torch.xpu.get_device_properties(index).total_memory
        reserved = torch.xpu.memory_reserved(index)
        info.update(gpu_used=_mb(reserved), gpu_total=_mb(total),
                    gpu_allocated=_mb(torch.xpu.memory_allocated(index)),
                    gpu_reserved=_mb(reserved), gpu_device=f"xpu:{index}")
    elif hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        # MPS shares system memory: "total" is what Metal recommends using.
        allocated = torch.mps.current_allocated_memory()
        info.update(gpu_used=_mb(torch.mps.driver_allocated_memory()),
                    gpu_total=_mb(getattr(torch.mps, "recommended_max_memory", lambda: vm.total)()),
                    gpu_allocated=_mb(allocated), gpu_reserved=_mb(allocated), gpu_device="mps")
    return info


def _os_io_counters() -> tuple:
    """(read_bytes, write_bytes, source): disk counters, else this process's, else none."""
    try:
        disk = psutil.disk_io_counters()
    except Exception:  # some containers and Windows without disk performance counters
        disk = None
    if disk is not None:
        return disk.read_bytes, disk.write_bytes, "disk"
    try:
        proc = psutil.Process().io_counters()  # not on macOS
        return proc.read_bytes, proc.write_bytes, "process"
    except Exception:
        return 0, 0, "unavailable"


def _sample() -> Dict[str, Any]:
    read, write, source = _os_io_counters()
    with _lock:
        own_read, own_write = _own_io["read"], _own_io["write"]
    return {"t": time.monotonic(), "read": read, "write": write, "source": source,
            "own_read": own_read, "own_write": own_write}


_previous: Optional[Dict[str, Any]] = None


def get_io_stats() -> Dict[str, Any]:
    """IO rates in MB/s since the previous call (the first call: since this module loaded)."""
    global _previous
    now = _sample()
    with _lock:
        before, _previous = _previous, now
    before = before if before is not None else _start
    elapsed = max(now["t"] - before["t"], 1e-6)

    def rate(key: str) -> float:
        return round(max(now[key] - before[key], 0) / MB / elapsed, 1)

    return {"read_speed": rate("read"), "write_speed": rate("write"),
            "shardwise_read_speed": rate("own_read"), "shardwise_write_speed": rate("own_write"),
            "interval_s": round(elapsed, 3), "source": now["source"]}


def _windows_performance_info() -> Optional[Dict[str, float]]:
    """GetPerformanceInfo in bytes (None if the call is unavailable)."""
    try:
        import ctypes
        from ctypes import wintypes

        class PerformanceInformation(ctypes.Structure):
            _fields_ = [("cb", wintypes.DWORD), ("CommitTotal", ctypes.c_size_t),
                        ("CommitLimit", ctypes.c_size_t), ("CommitPeak", ctypes.c_size_t),
                        ("PhysicalTotal", ctypes.c_size_t), ("PhysicalAvailable", ctypes.c_size_t),
                        ("SystemCache", ctypes.c_size_t), ("KernelTotal", ctypes.c_size_t),
                        ("KernelPaged", ctypes.c_size_t), ("KernelNonpaged", ctypes.c_size_t),
                        ("PageSize", ctypes.c_size_t), ("HandleCount", wintypes.DWORD),
                        ("ProcessCount", wintypes.DWORD), ("ThreadCount", wintypes.DWORD)]

        perf = PerformanceInformation()
        perf.cb = ctypes.sizeof(perf)
        if not ctypes.windll.psapi.GetPerformanceInfo(ctypes.byref(perf), perf.cb):
            return None
        page = perf.PageSize
        return {"commit_total": perf.CommitTotal * page, "commit_limit": perf.CommitLimit * page,
                "system_cache": perf.SystemCache * page}
    except Exception:
        return None


def _swap() -> tuple:
    """(percent, used_bytes, total_bytes, label): psutil's swap/page-file reading.

    On Windows psutil reads the page file through performance counters, which can be
    disabled (and are under Wine): then the commit charge is the nearest honest measure.
    """
    page_file = sys.platform.startswith("win")
    try:
        swap = psutil.swap_memory()
        label = "page file in use, % of page file size" if page_file else \
            "swap in use, % of swap size (0 when there is no swap)"
        return float(swap.percent), swap.used, swap.total, label
    except (RuntimeError, OSError):
        perf = _windows_performance_info() if page_file else None
        if perf is None or not perf["commit_limit"]:
            return 0.0, 0, 0, "unavailable (no swap/page-file counters on this machine)"
        percent = 100.0 * perf["commit_total"] / perf["commit_limit"]
        return percent, perf["commit_total"], perf["commit_limit"], \
            "commit charge, % of commit limit (page file counters disabled)"


def get_platform_stats() -> Dict[str, Any]:
    """Page-file/swap usage (%) and system cache (MB), labelled with what they measure here."""
    percent, swap_used, swap_total, swap_label = _swap()
    vm = psutil.virtual_memory()
    if sys.platform.startswith("win"):
        perf = _windows_performance_info()
        cache = _mb(perf["system_cache"]) if perf is not None else None
        cache_label = "system file cache (GetPerformanceInfo SystemCache)" if cache is not None \
            else "unavailable (GetPerformanceInfo failed)"
        platform_name = "windows"
    elif sys.platform.startswith("linux"):
        cache = _mb(getattr(vm, "cached", 0) + getattr(vm, "buffers", 0))
        cache_label = "page cache: cached + buffers from /proc/meminfo"
        platform_name = "linux"
    else:
        # macOS: no page-cache counter in psutil; inactive pages are the nearest thing.
        inactive = getattr(vm, "inactive", None)
        cache = _mb(inactive) if inactive is not None else None
        cache_label = "inactive pages (reclaimable file cache)" if cache is not None \
            else "unavailable on this OS"
        platform_name = sys.platform
    return {"pagefile_usage": round(percent, 1), "system_cache": cache,
            "swap_used": _mb(swap_used), "swap_total": _mb(swap_total),
            "platform": platform_name,
            "labels": {"pagefile_usage": swap_label, "system_cache": cache_label}}


def get_windows_specific_stats() -> Dict[str, Any]:
    """The seed's name for ``get_platform_stats`` (works on every OS)."""
    return get_platform_stats()


def see_memory_usage(message: str, force: bool = True) -> Dict[str, Any]:
    """Log memory, IO and platform statistics at rank 0 and return them.

    ``force=False`` does nothing, as DeepSpeed's function of the same name.
    """
    if not force:
        return {}
    from .logging import log_dist
    mem, io, plat = get_memory_info(), get_io_stats(), get_platform_stats()
    log_dist(f"{message} | GPU ({mem['gpu_device']}) used {mem['gpu_used']:.1f}/"
             f"{mem['gpu_total']:.1f} MB, allocated {mem['gpu_allocated']:.1f} MB, reserved "
             f"{mem['gpu_reserved']:.1f} MB | CPU used {mem['cpu_used']:.1f}/{mem['cpu_total']:.1f}"
             f" MB, process RSS {mem['process_rss']:.1f} MB | IO read {io['read_speed']:.1f} MB/s,"
             f" write {io['write_speed']:.1f} MB/s (shardwise {io['shardwise_read_speed']:.1f}/"
             f"{io['shardwise_write_speed']:.1f} MB/s) | {plat['labels']['pagefile_usage']}: "
             f"{plat['pagefile_usage']:.1f}%, {plat['labels']['system_cache']}: "
             f"{plat['system_cache'] if plat['system_cache'] is not None else 'n/a'} MB", ranks=[0])
    return {"memory": mem, "io": io, "platform": plat}


_start = _sample()
