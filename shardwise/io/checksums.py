"""crc32 checksums of byte buffers, chunk by chunk, computed on a small thread pool.

zlib's crc32 releases the GIL on large buffers, so chunk-wise (not chained) crcs scale with
cores instead of capping a writer at one core's ~2 GB/s. The checkpoint writer records one
crc per chunk of every tensor; readers recompute them per chunk.
"""
from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import List, Union

#: A crc that is either known already or still being computed on the pool.
Crc = Union["Future[int]", int]


def crc_workers() -> int:
    """Threads of a checksum pool: all cores but one, at most 4."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


class ChunkCrcs:
    """crc32 of buffers handed in by a writer, computed on a pool while the writer goes on.

    At most ``2 * workers`` buffers are in flight, which bounds the work queued behind the
    writer. Buffers shorter than ``inline_bytes`` are checksummed on the calling thread:
    handing a few kilobytes to the pool costs more than the crc itself.
    """

    def __init__(self, inline_bytes: int = 1024 * 1024) -> None:
        workers = crc_workers()
        self.inline_bytes = inline_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardwise-crc")
        self._slots = threading.Semaphore(2 * workers)

    def submit(self, buf) -> Crc:
        """The crc32 of ``buf`` (a bytes-like object that must stay unchanged until it is known)."""
        if len(buf) < self.inline_bytes:
            return zlib.crc32(buf)
        self._slots.acquire()
        fut = self._pool.submit(zlib.crc32, buf)
        fut.add_done_callback(lambda _f: self._slots.release())
        return fut

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def crc_value(crc: Crc) -> int:
    """The value of a crc from :meth:`ChunkCrcs.submit`, waiting for it if needed."""
    return crc.result() if isinstance(crc, Future) else crc


def chunk_crcs(buf, chunk_bytes: int) -> List[int]:
    """The crc32 of each ``chunk_bytes`` piece of a byte buffer, in order."""
    view = memoryview(buf).cast("B")
    return [zlib.crc32(view[i:i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


def file_crc32(path: Union[str, Path], chunk_bytes: int = 32 * 1024 * 1024) -> int:
    """crc32 of a whole file, streamed ``chunk_bytes`` at a time."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)
