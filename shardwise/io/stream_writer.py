"""A streaming writer: tensors written back to back into an open file, with the
device-to-host copy, the checksum and the write of consecutive chunks overlapped.

CPU tensors are written straight from their memory (no copy). Device tensors are copied into
a :class:`~shardwise.io.pinned_ring.HostRing`; consecutive small tensors share one buffer (one
copy wait and one ``write`` instead of one per tensor), while a large one takes one buffer per
chunk. Filled buffers wait in a queue of ``LOOKAHEAD`` before they are written, so the
asynchronous copy of the next buffer overlaps the write of this one; crc32s run on a
:class:`~shardwise.io.checksums.ChunkCrcs` pool; :class:`Writeback` keeps the disk busy. The
bytes written and their crcs are exactly those of a plain chunk-by-chunk loop.
"""
from __future__ import annotations

import collections
from typing import Any, BinaryIO, List, Optional, Tuple, Union

import torch

from . import libc
from .checksums import ChunkCrcs, Crc
from .libc import LibcFn
from .pinned_ring import HostRing, Slot

#: ``sync_file_range`` flag: start writeback of dirty pages in the range, do not wait.
SYNC_FILE_RANGE_WRITE = 2

SyncFileRange = LibcFn
sync_file_range = libc.sync_file_range


class Writeback:
    """Starts the kernel's writeback of each ``window_bytes`` window as soon as it is written,
    so the disk works while the next tensors are copied, checksummed and written. Without it
    the bytes sit in the page cache until the final fsync, which then pays the whole disk
    time. This only starts IO early; durability still comes from the caller's fsync.

    ``fn`` is :func:`sync_file_range` (None or ``window_bytes <= 0``: off). A call that fails
    (a filesystem that refuses it) turns it off for the file.
    """

    def __init__(self, f: Any, fn: Optional[SyncFileRange], window_bytes: int) -> None:
        self._fn = fn if window_bytes > 0 else None
        self._window = window_bytes
        self._fd = f.fileno() if self._fn is not None else -1
        self._started = 0  # file offset up to which writeback was requested
        self.calls = 0

    def advance(self, end: int) -> None:
        if self._fn is None or end - self._started < self._window:
            return
        if self._fn(self._fd, self._started, end - self._started, SYNC_FILE_RANGE_WRITE) != 0:
            self._fn = None
            return
        self._started = end
        self.calls += 1


_Unit = Union[Slot, Tuple[int, Any]]


class StreamWriter:
    """Writes tensors to ``f`` (positioned at ``start``) back to back, ``chunk_bytes`` at a
    time; ``crcs[i]`` collects the per-chunk crcs of the ``i``-th tensor added."""

    LOOKAHEAD = 1

    def __init__(self, f: BinaryIO, start: int, n_items: int, crcs: ChunkCrcs,
                 writeback: Writeback, chunk_bytes: int, stage_host: bool = False,
                 ring: Optional[HostRing] = None) -> None:
        self._f, self._pos, self._crcs, self._writeback = f, start, crcs, writeback
        self._chunk = chunk_bytes
        self._stage_host = stage_host  # tests: run CPU tensors through the ring too
        self._ring = ring if ring is not None else HostRing(chunk_bytes)
        self._open: Optional[Slot] = None
        self._queue: "collections.deque[_Unit]" = collections.deque()
        self.crcs: List[List[Crc]] = [[] for _ in range(n_items)]

    @property
    def position(self) -> int:
        """The file offset after the last byte written so far."""
        return self._pos

    def add(self, index: int, tensor: torch.Tensor) -> None:
        """Queue the bytes of ``tensor`` (any device, dtype, layout) as item ``index``."""
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            return
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        raw = flat.contiguous().view(torch.uint8)
        chunk = self._chunk
        if raw.device.type == "cpu" and not self._stage_host:
            self._close_open()
            array = raw.numpy()
            for i in range(0, raw.numel(), chunk):
                # nothing asynchronous to overlap: write at once, so a producer's previous
                # tensor is not held while it makes the next one
                self._queue.append((index, array[i:i + chunk]))
                self._drain(0)
            return
        for i in range(0, raw.numel(), chunk):
            piece = raw[i:i + chunk]
            if self._open is not None and self._open.fill + piece.numel() > self._open.capacity:
                self._close_open()
            if self._open is None:
                self._open = self._acquire()
            self._open.stage(index, piece)

    def finish(self) -> None:
        """Write everything still queued."""
        self._close_open()
        self._drain(0)

    def _acquire(self) -> Slot:
        slot = self._ring.acquire()
        while not slot.written:  # never reached with ring > LOOKAHEAD + 1; kept as a guard
            self._write_next()
        slot.reset()
        return slot

    def _close_open(self) -> None:
        if self._open is not None:
            self._open.close()
            self._queue.append(self._open)
            self._open = None
            self._drain(self.LOOKAHEAD)

    def _drain(self, keep: int) -> None:
        while len(self._queue) > keep:
            self._write_next()

    def _write_next(self) -> None:
        unit = self._queue.popleft()
        if isinstance(unit, Slot):
            unit.wait()  # the copies into this buffer are done
            for index, lo, hi in unit.pieces:
                crc = self._crcs.submit(unit.array[lo:hi])
                unit.crcs.append(crc)
                self.crcs[index].append(crc)
            self._f.write(unit.array[:unit.fill])
            self._pos += unit.fill
            unit.written = True
        else:
            index, array = unit
            self.crcs[index].append(self._crcs.submit(array))
            self._f.write(array)
            self._pos += len(array)
        self._writeback.advance(self._pos)
