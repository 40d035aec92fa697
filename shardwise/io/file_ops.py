"""The system calls behind the async handle: how one request is cut into blocks and how a
block moves between a file and memory.

A request (one tensor, one file, one offset) becomes blocks of ``block_size`` bytes that the
handle's threads move independently. Two ways to reach the file:

- positional (Linux, macOS): one descriptor per request shared by every thread, and
  ``os.preadv`` / ``os.pwritev`` straight into a memoryview of the tensor's memory; the call
  releases the GIL. On Linux, blocks whose file offset and length are :data:`ALIGN`-aligned
  go through a second, ``O_DIRECT`` descriptor (no page cache); when the buffer address is
  not aligned such a block goes through the thread's aligned bounce buffer. The unaligned
  head and tail of a request use the buffered descriptor. A filesystem that refuses
  ``O_DIRECT`` (tmpfs, some network filesystems) gets buffered IO and one log line.
- per-thread handles (Windows, which has neither ``pread`` nor ``O_DIRECT``): each thread
  opens its own unbuffered handle on the file and does ``seek`` + ``readinto`` / ``write``
  on it; ``FileIO`` releases the GIL in both calls.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Callable, Dict, Iterator, List, Optional, Set

import torch

from ..errors import StorageError
from . import libc
from .aligned import ALIGN, alloc_aligned

#: True where ``os.preadv``/``os.pwritev`` exist (not on Windows).
HAS_POSITIONAL = hasattr(os, "preadv") and hasattr(os, "pwritev")
#: True where the OS has ``O_DIRECT`` (Linux).
HAS_O_DIRECT = hasattr(os, "O_DIRECT")
_BINARY = getattr(os, "O_BINARY", 0)


@dataclass(frozen=True)
class Block:
    """``length`` bytes at ``file_offset``, at ``buf_offset`` in the request's buffer;
    ``direct``: offset and length are aligned, so O_DIRECT may move it."""

    file_offset: int
    buf_offset: int
    length: int
    direct: bool


def plan_blocks(file_offset: int, nbytes: int, block_size: int, direct: bool) -> List[Block]:
    """Cut ``nbytes`` at ``file_offset`` into blocks. With ``direct`` the unaligned head (up
    to the next ALIGN boundary) and tail are blocks of their own and every block in between
    is aligned (``block_size`` rounded down to ALIGN, at least ALIGN)."""
    if not direct:
        return [Block(file_offset + lo, lo, min(block_size, nbytes - lo), False)
                for lo in range(0, nbytes, block_size)]
    step = max(ALIGN, block_size - block_size % ALIGN)
    blocks: List[Block] = []
    pos = min(nbytes, -file_offset % ALIGN)
    if pos:
        blocks.append(Block(file_offset, 0, pos, False))
    while pos < nbytes:
        n = min(step, nbytes - pos)
        aligned = n - n % ALIGN
        if aligned:
            blocks.append(Block(file_offset + pos, pos, aligned, True))
        if n != aligned:
            blocks.append(Block(file_offset + pos + aligned, pos + aligned, n - aligned, False))
        pos += n
    return blocks


_LOGGED_FOLDERS: Set[str] = set()  # folders whose O_DIRECT refusal was logged (once per process)
_LOGGED_LOCK = threading.Lock()


class DirectFallback:
    """Remembers, per handle, that O_DIRECT was refused; says so once per folder and process."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self._log = log
        self.refused = False

    def refuse(self, path: str, err: OSError) -> None:
        self.refused = True
        folder = os.path.dirname(os.path.abspath(path))
        with _LOGGED_LOCK:
            if folder in _LOGGED_FOLDERS:
                return
            _LOGGED_FOLDERS.add(folder)
        self._log(f"aio: O_DIRECT is not supported for {path} ({err.strerror or err}); "
                  "using buffered IO (the page cache) there.")


_memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies


class _Bounce(threading.local):
    buf: Optional[torch.Tensor] = None


_BOUNCE = _Bounce()


def _bounce(nbytes: int) -> torch.Tensor:
    """This thread's aligned bounce buffer of at least ``nbytes``."""
    buf = _BOUNCE.buf
    if buf is None or buf.numel() < nbytes:
        buf = _BOUNCE.buf = alloc_aligned(max(nbytes, ALIGN))
    return buf


def _full(call: Callable[[memoryview, int], int], view: memoryview, offset: int,
          path: str, reading: bool) -> None:
    """Repeat a positional call until all of ``view`` moved (system calls may move less)."""
    done = 0
    while done < len(view):
        n = call(view[done:], offset + done)
        if n <= 0:
            what = "ended" if reading else "accepted no more bytes"
            raise StorageError(f"{path}: the file {what} at byte {offset + done} while "
                               f"{'reading' if reading else 'writing'} {len(view)} bytes at "
                               f"offset {offset}.")
        done += n


_fallocate = libc.fallocate


#: Allocate the blocks of an O_DIRECT write that extends its file before the threads write
#: them. Writes past the end of a file, or into holes, take ext4's and XFS's inode lock
#: exclusively, which runs the threads' direct writes one at a time; writes into allocated
#: (unwritten) extents inside the file run in parallel. Allocation is metadata only.
PREALLOCATE = True


#: Serializes seeking IO on callers' descriptors (Windows has no pread/pwrite): every
#: request on one descriptor moves its one shared file position.
_DESCRIPTOR_LOCK = threading.Lock()


@contextmanager
def _kept_position(f: BinaryIO) -> Iterator[BinaryIO]:
    """``f`` (over a caller's descriptor) to seek and move on, alone; the caller's file position
    is back afterwards, as after pread/pwrite."""
    with _DESCRIPTOR_LOCK:
        position = f.tell()
        try:
            yield f
        finally:
            f.seek(position)


def read_descriptor(fd: int, offset: int, nbytes: int) -> bytes:
    """``nbytes`` at ``offset`` of a caller's open descriptor, its file position kept."""
    with open(fd, "rb", buffering=0, closefd=False) as raw, _kept_position(raw) as f:
        f.seek(offset)
        return f.read(nbytes)


class RequestFiles:
    """The open handles of one request on ``path`` (``fd`` given: the caller's descriptor,
    never closed, used positionally, or where the OS has no pread/pwrite through one handle
    over it, a block at a time). Thread-safe: every method may run on any thread."""

    def __init__(self, path: str, write: bool, direct: bool, fallback: DirectFallback,
                 positional: bool = HAS_POSITIONAL, fd: Optional[int] = None) -> None:
        # a caller's descriptor cannot be reopened by name: positional where the OS can, else
        # one handle over it, one block at a time (Windows)
        self.path, self.write = path, write
        self.positional = positional or (fd is not None and HAS_POSITIONAL)
        self._fallback = fallback
        self._own = fd is None
        self._lock = threading.Lock()
        self._threads: Dict[int, BinaryIO] = {}
        self._shared: Optional[BinaryIO] = None
        if fd is not None and not self.positional:
            self._shared = os.fdopen(fd, "wb" if write else "rb", buffering=0, closefd=False)
        flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | _BINARY
        self._fd = fd if fd is not None else self._open(flags)
        self._dfd = -1
        if direct and self._own and self.positional and HAS_O_DIRECT and not fallback.refused:
            try:
                self._dfd = os.open(path, flags | os.O_DIRECT, 0o666)
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                fallback.refuse(path, err)
        if not self.positional and self._own:  # the per-thread handles reopen by name
            os.close(self._fd)
            self._fd = -1

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags, 0o666)
        except OSError as err:
            raise StorageError(f"{self.path}: cannot open for {'writing' if self.write else 'reading'}"
                               f" ({err.strerror or err}).") from None

    @property
    def direct(self) -> bool:
        return self._dfd >= 0

    def preallocate(self, offset: int, nbytes: int) -> None:
        """Before direct writes that extend the file: allocate ``[offset, offset + nbytes)``
        (existing data is kept). Silently nothing where the filesystem cannot."""
        fn = _fallocate() if PREALLOCATE and self.write and self._dfd >= 0 else None
        if fn is None or nbytes <= 0 or os.fstat(self._fd).st_size >= offset + nbytes:
            return
        fn(self._fd, 0, offset, nbytes)  # -1 (EOPNOTSUPP, ...): the writes still work

    def move(self, block: Block, address: int, view: memoryview) -> None:
        """Move one block between the file and ``view`` (the block's bytes at ``address``)."""
        if not self.positional:
            self._move_seek(block, view)
        elif block.direct and self._dfd >= 0:
            try:
                self._move_direct(block, address, view)
                return
            except OSError as err:
                if err.errno != errno.EINVAL or isinstance(err, StorageError):
                    raise
                self._fallback.refuse(self.path, err)  # the filesystem took the open, not the IO
                self._move_plain(self._fd, block, view)
        else:
            self._move_plain(self._fd, block, view)

    def _move_plain(self, fd: int, block: Block, view: memoryview) -> None:
        if self.write:
            _full(lambda v, o: os.pwritev(fd, [v], o), view, block.file_offset, self.path, False)
        else:
            _full(lambda v, o: os.preadv(fd, [v], o), view, block.file_offset, self.path, True)

    def _move_direct(self, block: Block, address: int, view: memoryview) -> None:
        if address % ALIGN == 0:
            self._move_plain(self._dfd, block, view)
            return
        bounce = _bounce(block.length)
        staged = memoryview(bounce.numpy())[:block.length]
        if self.write:
            _memmove(bounce.data_ptr(), address, block.length)
            self._move_plain(self._dfd, block, staged)
        else:
            self._move_plain(self._dfd, block, staged)
            _memmove(address, bounce.data_ptr(), block.length)

    def _thread_file(self) -> BinaryIO:
        key = threading.get_ident()
        with self._lock:
            f = self._threads.get(key)
            if f is None:
                mode = "r+b" if self.write else "rb"
                try:
                    f = self._threads[key] = open(self.path, mode, buffering=0)
                except OSError as err:
                    raise StorageError(f"{self.path}: cannot open ({err.strerror or err}).") from None
        return f

    def _move_seek(self, block: Block, view: memoryview) -> None:
        if self._shared is None:
            self._seek_move(self._thread_file(), block, view)
        else:
            with _kept_position(self._shared) as f:
                self._seek_move(f, block, view)

    def _seek_move(self, f: BinaryIO, block: Block, view: memoryview) -> None:
        f.seek(block.file_offset)
        if self.write:
            _full(lambda v, _o: f.write(v) or 0, view, block.file_offset, self.path, False)
        else:
            _full(lambda v, _o: f.readinto(v) or 0, view, block.file_offset, self.path, True)

    def close(self) -> None:
        with self._lock:
            handles, self._threads = list(self._threads.values()), {}
            if self._shared is not None:  # closefd=False: the descriptor stays the caller's
                handles.append(self._shared)
                self._shared = None
        for f in handles:
            f.close()
        for fd in (self._dfd, self._fd if self._own else -1):
            if fd >= 0:
                os.close(fd)
        self._dfd = self._fd = -1


def file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as err:
        raise StorageError(f"{path}: cannot read ({err.strerror or err}).") from None


def default_positional() -> bool:
    """Positional IO where the OS has it; per-thread handles on Windows."""
    return HAS_POSITIONAL and sys.platform != "win32"
