"""Linux libc calls that Python's ``os`` module lacks, looked up once through ctypes.

``fallocate`` (real preallocation; ``os.posix_fallocate`` is emulated by writing zeros where
the filesystem lacks it) and ``sync_file_range`` (start writeback without waiting). Each is
None off Linux or where the C library has no such symbol; callers then do without.
"""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable, Optional, Sequence

LibcFn = Callable[[int, int, int, int], int]


@functools.lru_cache(maxsize=None)
def _lookup(name: str, argtypes: Sequence[type]) -> Optional[LibcFn]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # no glibc symbol (e.g. an unusual libc)
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def fallocate() -> Optional[LibcFn]:
    """``fallocate(fd, mode, offset, length)``."""
    return _lookup("fallocate", (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64))


def sync_file_range() -> Optional[LibcFn]:
    """``sync_file_range(fd, offset, nbytes, flags)``."""
    return _lookup("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))
