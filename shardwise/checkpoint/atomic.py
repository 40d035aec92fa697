"""Crash-safe file writes: write to a temporary name in the same folder, fsync, rename.

A reader sees either the old file or the complete new one, never a half-written file: the
data goes to ``<name>.tmp-<pid>-<n>`` first, is flushed to disk, and only then replaces the
target with :func:`os.replace`. ``os.replace`` (unlike ``os.rename``) overwrites an existing
target on Windows too, and it is atomic on every local filesystem PyTorch runs on.

These helpers are public because the launcher, the config dumps and the Windows CI reuse them:

>>> atomic_write_bytes(Path("latest"), b"global_step10")
>>> with atomic_open(Path("big.bin")) as f:
...     f.write(chunk)
"""
from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Union

from ..errors import CheckpointError

PathLike = Union[str, "os.PathLike[str]"]

_counter = itertools.count()

#: Suffix marker of temporary files; the loader and the cleanup code ignore such names.
TMP_MARKER = ".tmp-"


def temp_name_for(path: Path) -> Path:
    """A temporary sibling of ``path``, unique per process and call (no ':' in it, for Windows)."""
    return path.with_name(f"{path.name}{TMP_MARKER}{os.getpid()}-{next(_counter)}")


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename) to disk where the OS allows it.

    POSIX needs this for a rename to survive a power cut; Windows cannot open a directory
    for fsync and persists renames with the file's metadata, so there it is skipped.
    """
    if os.name == "nt":
        return
    try:
        fd = os.open(str(directory), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        # Some filesystems (e.g. certain network mounts) refuse directory fsync; the rename
        # itself is still atomic there, only its durability across a power cut is weaker.
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: PathLike, fsync: bool = True) -> Iterator[BinaryIO]:
    """Open ``path`` for binary writing so that it only appears once complete.

    Yields a file object writing to a temporary sibling. On normal exit the file is flushed,
    fsync'ed (unless ``fsync=False``) and renamed onto ``path``; on an exception the
    temporary file is deleted and ``path`` is left untouched.
    """
    target = Path(path)
    if ":" in target.name:
        raise CheckpointError(
            f"file name {target.name!r} contains ':'; Windows forbids it in file names. "
            "Choose a name without ':' (e.g. replace it with '-').")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name_for(target)
    f = open(tmp, "wb")
    try:
        yield f
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, target)
    except BaseException:
        f.close()
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(target.parent)


def atomic_write_bytes(path: PathLike, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (temporary name + fsync + ``os.replace``)."""
    with atomic_open(path, fsync=fsync) as f:
        f.write(data)


def atomic_write_text(path: PathLike, text: str, fsync: bool = True) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def remove_stale_temps(directory: PathLike) -> int:
    """Delete temporary files left by a killed writer in ``directory``; returns how many."""
    removed = 0
    folder = Path(directory)
    if not folder.is_dir():
        return 0
    for entry in folder.iterdir():
        if TMP_MARKER in entry.name and entry.is_file():
            try:
                entry.unlink()
                removed += 1
            except OSError:
                pass
    return removed
