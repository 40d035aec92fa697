"""The swap folder of one rank of one run under ``nvme_path``, checked when it is made.

``SwapDir(nvme_path, rank)`` creates ``nvme_path/shardwise_swap/<run>-rank<rank>/``, writes,
syncs, reads back and deletes a small probe file there, and raises an error naming the path
and the fix for each way it can fail: ``nvme_path`` missing from the config, a regular file,
a folder that cannot be created, a read-only or full disk (also: less free space than the
caller says it needs). The folder is removed by :meth:`SwapDir.close` and, if the program
never calls it, at interpreter exit (DeepSpeed leaves its swap files behind).
"""
from __future__ import annotations

import errno
import os
import shutil
import time
import weakref
from pathlib import Path
from typing import Optional, Union

from ..errors import ConfigError, StorageError

SWAP_ROOT = "shardwise_swap"
PROBE_BYTES = 64 * 1024
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()  # the shared shardwise_swap folder, when no other run uses it
    except OSError:
        pass


class SwapDir:
    """A per-rank, per-run folder for swap files. ``key`` is the config key that named
    ``nvme_path`` (used in messages); ``required_bytes``: refuse a disk with less free space."""

    def __init__(self, nvme_path: Union[str, os.PathLike, None], rank: int = 0,
                 key: str = "offload_optimizer.nvme_path", required_bytes: int = 0,
                 run_id: Optional[str] = None) -> None:
        if nvme_path is None or not str(nvme_path).strip():
            raise ConfigError(f"{key} is not set, but device \"nvme\" keeps its swap files there. "
                              f"Set it to a folder on a fast local disk, e.g. \"nvme_path\": "
                              f"\"/local_nvme\", or use \"device\": \"cpu\".")
        self.key = key
        self.root = Path(nvme_path).expanduser()
        run = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}"
        self.path = self.root / SWAP_ROOT / f"{run}-rank{rank:05d}"
        self._make_root()
        self._make(self.path)
        self._finalizer = weakref.finalize(self, _remove, self.path)
        try:
            self._probe()
            self._check_space(required_bytes)
        except BaseException:
            self.close()
            raise

    def _fail(self, path: Path, problem: str, err: Optional[OSError] = None) -> StorageError:
        reason = f" ({err.strerror or err})" if err is not None else ""
        return StorageError(f"{self.key} = {str(self.root)!r}: {problem}{reason}; swap files "
                            f"go to {path}. Point {self.key} at a writable folder on a local disk "
                            "with room for the offloaded tensors.")

    def _make_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise self._fail(self.root, "is a regular file, not a folder")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._fail(self.root, "the folder cannot be created", err) from None

    def _make(self, path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            problem = "is read-only" if err.errno in _READ_ONLY else "the folder cannot be created"
            raise self._fail(path, problem, err) from None

    def _probe(self) -> None:
        """Write, sync, read back and delete a small file: read-only and full disks fail here."""
        probe = self.path / ".probe"
        data = os.urandom(PROBE_BYTES)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write")
                os.fsync(fd)
            finally:
                os.close(fd)
            if probe.read_bytes() != data:
                raise OSError(errno.EIO, "the probe file read back differently")
            probe.unlink()
        except OSError as err:
            if err.errno in _READ_ONLY:
                raise self._fail(self.path, "is read-only", err) from None
            if err.errno in _FULL:
                raise self._fail(self.path, "the disk is full", err) from None
            raise self._fail(self.path, "a probe write failed", err) from None

    def _check_space(self, required: int) -> None:
        if required <= 0:
            return
        free = shutil.disk_usage(self.path).free
        if free < required:
            raise self._fail(self.path, f"the disk is too full: the swap files need {_gib(required)}"
                                        f" but {_gib(free)} is free")

    def file(self, name: str) -> Path:
        """The path of swap file ``name`` in this folder."""
        if not name or os.sep in name or "/" in name or name.startswith("."):
            raise StorageError(f"swap file name {name!r} must be a plain file name.")
        return self.path / name

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the folder and every swap file in it (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "SwapDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
