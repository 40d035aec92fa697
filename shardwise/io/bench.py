"""Throughput of the IO layer against a plain sequential baseline, on one file.

:func:`measure` writes and reads ``size`` bytes through an :class:`AsyncIOHandle` and through a
dd-style loop (one thread, one ``block_size`` buffer, ``O_DIRECT`` when direct IO is asked
for, like ``dd oflag=direct`` / ``iflag=direct``) in the same run, so the ratio between the
two says what the layer costs or gains on this disk. Reads never come from the page cache:
``O_DIRECT`` bypasses it and buffered runs drop the file's pages first
(``posix_fadvise(DONTNEED)`` after an fsync); buffered writes include their fsync.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..errors import StorageError
from .aio_handle import AsyncIOHandle
from .aligned import ALIGN, alloc_aligned
from .file_ops import HAS_O_DIRECT

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str, flag: str) -> int:
    """``"1G"`` → 2³⁰, ``"256K"``/``"256KiB"``/``"256KB"`` → 256·2¹⁰ (ds_io's binary units)."""
    match = _SIZE.match(str(value))
    if match is None:
        raise StorageError(f"{flag} {value!r} is not a size; use e.g. 1G, 256M, 64K or bytes.")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise StorageError(f"{flag} {value!r} must be positive.")
    return size


@dataclass
class BenchConfig:
    """What to measure."""

    folder: Path
    """Folder the test file is written in (removed when done)."""
    size: int = 1 << 30
    """Bytes written and read per loop."""
    block_size: int = 1 << 20
    """Bytes per request block."""
    queue_depth: int = 8
    """Blocks in flight per unit of intra_op_parallelism."""
    threads: int = 4
    """intra_op_parallelism of the handle."""
    direct: bool = True
    """O_DIRECT where the filesystem allows it (else buffered + fsync + fadvise)."""
    gds: bool = False
    """use_gds on the handle (kvikio) with a CUDA buffer."""
    gpu: bool = False
    """Move the data to/from a CUDA tensor (through pinned host memory unless gds)."""
    loops: int = 1
    """Repetitions; GB/s is the mean over them."""
    read: bool = True
    """Measure reads."""
    write: bool = True
    """Measure writes."""
    baseline: bool = True
    """Measure the dd-style baseline too."""


@dataclass
class BenchResult:
    """GB/s (10⁹ bytes per second) of each measured direction; None: not measured."""

    read_gbps: Optional[float] = None
    write_gbps: Optional[float] = None
    baseline_read_gbps: Optional[float] = None
    baseline_write_gbps: Optional[float] = None
    direct: bool = False
    """Whether O_DIRECT was actually used (False: asked for buffered, or refused)."""
    verified: bool = False
    """The bytes read back equal the bytes written."""
    size_bytes: int = 0
    block_size: int = 0
    queue_depth: int = 0
    threads: int = 0
    io_threads: int = 0
    gds: bool = False
    loops: int = 0
    path: str = ""
    samples: Dict[str, List[float]] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, object]:
        out = asdict(self)
        for kind in ("read", "write"):
            ours, base = out[f"{kind}_gbps"], out[f"baseline_{kind}_gbps"]
            out[f"{kind}_vs_baseline"] = round(ours / base, 3) if ours and base else None
        return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))  # Windows cannot fsync read-only
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """Evict ``path``'s pages from the page cache where the OS can (fsync, then DONTNEED)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open_dd(path: Path, write: bool, direct: bool) -> int:
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | getattr(os, "O_BINARY", 0)
    if direct and HAS_O_DIRECT:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o666)
        except OSError:
            pass
    return os.open(path, flags, 0o666)


def dd_pass(path: Path, size: int, block_size: int, write: bool, direct: bool) -> float:
    """One sequential pass like ``dd bs=block_size`` (``oflag/iflag=direct`` when ``direct``):
    seconds taken, fsync included for writes."""
    step = max(ALIGN, block_size - block_size % ALIGN)
    buf = alloc_aligned(step)
    view = memoryview(buf.numpy())
    if not write:
        drop_cache(path)
    if write:
        path.unlink(missing_ok=True)
    fd = _open_dd(path, write, direct)
    try:
        start = time.perf_counter()
        done = 0
        while done < size:
            n = min(step, size - done)
            moved = os.write(fd, view[:n]) if write else os.readv(fd, [view[:n]]) \
                if hasattr(os, "readv") else len(os.read(fd, n))
            if moved <= 0:
                raise StorageError(f"{path}: the baseline {'write' if write else 'read'} stopped at {done}.")
            done += moved
        if write:
            os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def _fill(buf: torch.Tensor) -> None:
    """A cheap non-constant pattern (so a misplaced block shows up on verification)."""
    words = buf.numel() // 8
    if words:
        buf[:words * 8].view(torch.int64).copy_(torch.arange(words, dtype=torch.int64) * 2654435761)
    buf[words * 8:].fill_(7)


def _device_buffer(cfg: BenchConfig, host: torch.Tensor) -> Optional[torch.Tensor]:
    if not (cfg.gpu or cfg.gds):
        return None
    if not torch.cuda.is_available():
        raise StorageError("--gpu/--gds need a CUDA device; none is available here.")
    return host.to("cuda")


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _layer_pass(handle: AsyncIOHandle, cfg: BenchConfig, path: Path, host: torch.Tensor,
                dev: Optional[torch.Tensor], write: bool) -> float:
    """One write or read of the whole file through the handle (plus the device copy for
    --gpu without gds, as an offload would do it)."""
    target = dev if cfg.gds and dev is not None else host
    if not write:
        drop_cache(path)

    if write:
        path.unlink(missing_ok=True)  # every write pass allocates its blocks afresh

    def run() -> None:
        if write:
            if dev is not None and target is host:
                host.copy_(dev)
            handle.sync_pwrite(target, str(path), 0)
            if not cfg.direct or handle.direct_refused:
                _fsync(path)
        else:
            handle.sync_pread(target, str(path), 0)
            if dev is not None and target is host:
                dev.copy_(host)
                torch.cuda.synchronize()
    return _timed(run)


def measure(cfg: BenchConfig) -> BenchResult:
    """Write/read ``cfg.size`` bytes through the IO layer and the dd-style baseline."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    path = cfg.folder / f"shardwise_io_bench_{os.getpid()}.bin"
    res = BenchResult(size_bytes=cfg.size, block_size=cfg.block_size, queue_depth=cfg.queue_depth,
                      threads=cfg.threads, gds=cfg.gds, loops=cfg.loops, path=str(path))
    handle = AsyncIOHandle(cfg.block_size, cfg.queue_depth, False, True, cfg.threads,
                           use_gds=cfg.gds, direct=cfg.direct)
    res.io_threads = handle.thread_count
    samples: Dict[str, List[float]] = {k: [] for k in ("write", "read", "baseline_write", "baseline_read")}
    try:
        host = handle.new_cpu_locked_tensor(cfg.size, torch.empty(0, dtype=torch.uint8))
        _fill(host)
        reference = host.clone()
        dev = _device_buffer(cfg, host)
        for _ in range(cfg.loops):
            if cfg.write or not path.exists():
                seconds = _layer_pass(handle, cfg, path, host, dev, write=True)
                if cfg.write:
                    samples["write"].append(_gbps(cfg.size, seconds))
            if cfg.read:
                host.zero_()
                samples["read"].append(_gbps(cfg.size, _layer_pass(handle, cfg, path, host, dev, False)))
                res.verified = bool(torch.equal(dev.cpu() if dev is not None else host, reference))
            if cfg.baseline:
                if cfg.write:
                    samples["baseline_write"].append(
                        _gbps(cfg.size, dd_pass(path, cfg.size, cfg.block_size, True, cfg.direct)))
                if cfg.read:
                    samples["baseline_read"].append(
                        _gbps(cfg.size, dd_pass(path, cfg.size, cfg.block_size, False, cfg.direct)))
        res.direct = cfg.direct and HAS_O_DIRECT and not handle.direct_refused
    finally:
        handle.close()
        path.unlink(missing_ok=True)
    for key, values in samples.items():
        if values:
            setattr(res, f"{key}_gbps", round(sum(values) / len(values), 3))
    res.samples = {k: [round(v, 3) for v in vals] for k, vals in samples.items() if vals}
    return res
