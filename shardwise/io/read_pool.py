"""Chunk-parallel reads: a process-wide thread pool, per-thread file handles, and a helper
that reads the spans of one buffer on the pool, checksumming each piece while it is hot.

One thread reading a whole tensor and then checksumming it caps at one core's page-fault +
copy + crc speed (~1.5 GB/s); file reads and ``zlib.crc32`` release the GIL, so chunks read by
several threads straight into their slices of one output buffer scale with cores. Every
thread reads through its own handle (a shared handle's seek position would race); this is
also what works on Windows, which has no ``pread``.
"""
from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, BinaryIO, Callable, List, Optional, Sequence, Tuple, Union

_READ_POOL: Optional[ThreadPoolExecutor] = None
_READ_POOL_LOCK = threading.Lock()


def read_workers() -> int:
    """Threads reading the chunks of one buffer: 8 saturate page-cache reads and crc32 on a
    16-core host without taking every core from the rest of the load."""
    return max(1, min(8, os.cpu_count() or 2))


def read_pool() -> ThreadPoolExecutor:
    """A process-wide pool for chunk-parallel reads (created on first use)."""
    global _READ_POOL
    with _READ_POOL_LOCK:
        if _READ_POOL is None:
            _READ_POOL = ThreadPoolExecutor(max_workers=read_workers(),
                                            thread_name_prefix="shardwise-read")
        return _READ_POOL


def readinto_full(f: Any, out: Any) -> int:
    """Read into all of ``out`` unless the file ends first; the number of bytes read. (A raw
    file's ``readinto`` is one system call, which may return less than asked.)"""
    view = memoryview(out).cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


class ThreadFiles:
    """One unbuffered read handle on ``path`` per thread, opened on first use by that thread
    and all closed by :meth:`close` (after which :meth:`get` raises ValueError)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._handles: Optional[List[BinaryIO]] = []

    def get(self) -> BinaryIO:
        f = getattr(self._local, "f", None)
        if f is None:
            with self._lock:
                if self._handles is None:
                    raise ValueError(f"reader for {self.path} is closed")
                f = open(self.path, "rb", buffering=0)
                self._handles.append(f)
            self._local.f = f
        return f

    def read_at(self, offset: int, out: Any) -> Tuple[int, int]:
        """Read ``len(out)`` bytes at ``offset`` into ``out``: (bytes read, their crc32)."""
        f = self.get()
        f.seek(offset)
        got = readinto_full(f, out)
        return got, zlib.crc32(memoryview(out).cast("B")[:got])

    def close(self) -> None:
        with self._lock:
            handles, self._handles = self._handles, None
        for f in handles or ():
            f.close()


def read_spans(read_at: Callable[[int, Any], Tuple[int, int]], offset: int, out: Any,
               spans: Sequence[Tuple[int, int]], workers: int) -> List[Tuple[int, int]]:
    """Read each ``[lo, hi)`` span of ``out`` from file ``offset + lo`` with ``read_at``, on the
    pool when there are several spans and ``workers > 1``; returns (bytes, crc32) per span.
    Every span has finished before anything is raised, so none still writes into ``out``."""
    if len(spans) > 1 and workers > 1:
        pool = read_pool()
        futures = [pool.submit(read_at, offset + lo, out[lo:hi]) for lo, hi in spans]
        wait(futures)
        return [f.result() for f in futures]
    return [read_at(offset + lo, out[lo:hi]) for lo, hi in spans]
