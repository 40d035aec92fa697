"""File-system semantics shardwise relies on, asserted on the platform the tests run on.

Under scripts/windows-ci.sh these run on a real Windows CPython (under Wine), so the
Windows branches are exercised for real; on Linux the POSIX branches run. Each test
first pins down the operating-system behaviour the library depends on, then checks that
the library's own code copes with it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.windows

ON_WINDOWS = sys.platform == "win32"


def test_interpreter_is_the_expected_platform() -> None:
    # The Windows job must really be on Windows: a Linux interpreter picked up by mistake
    # would make the whole subset meaningless.
    if os.environ.get("SHARDWISE_EXPECT_WINDOWS") == "1":
        assert ON_WINDOWS, f"expected a Windows interpreter, got sys.platform={sys.platform!r}"
    if ON_WINDOWS:
        assert os.sep == "\\"
        assert os.name == "nt"
        import multiprocessing as mp
        # Windows has no fork: every worker shardwise starts must survive spawn pickling.
        assert mp.get_all_start_methods() == ["spawn"]


def test_rename_onto_existing_file(tmp_path: Path) -> None:
    src, dst = tmp_path / "new.bin", tmp_path / "old.bin"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    if ON_WINDOWS:
        # The reason shardwise never uses os.rename for "write temp, then move into place".
        with pytest.raises(FileExistsError):
            os.rename(src, dst)
        assert dst.read_bytes() == b"old"
    else:
        os.rename(src, dst)
        assert dst.read_bytes() == b"new"
        src.write_bytes(b"new")
    # os.replace overwrites on every platform: the primitive of atomic writes.
    src.write_bytes(b"newer")
    os.replace(src, dst)
    assert dst.read_bytes() == b"newer"
    assert not src.exists()


def test_open_file_cannot_be_deleted_on_windows(tmp_path: Path) -> None:
    path = tmp_path / "held.bin"
    path.write_bytes(b"x")
    with open(path, "rb"):
        if ON_WINDOWS:
            # Code that deletes or replaces a file must close its handles first on Windows.
            with pytest.raises(PermissionError):
                os.remove(path)
        else:
            os.remove(path)
    assert path.exists() == ON_WINDOWS


def test_drive_letter_and_backslash_paths_resolve(tmp_path: Path) -> None:
    target = tmp_path / "sub dir" / "ünï.txt"
    target.parent.mkdir()
    target.write_text("ok", encoding="utf-8")
    if ON_WINDOWS:
        text = str(target)
        assert text[1] == ":" and "\\" in text, text  # a drive letter and backslashes
        # Forward slashes and backslashes name the same file on Windows.
        assert Path(text.replace("\\", "/")).read_text(encoding="utf-8") == "ok"
        # A relative path from the same drive root reaches it too.
        rel = os.path.relpath(text, start=Path(text).anchor)
        assert (Path(Path(text).anchor) / rel).read_text(encoding="utf-8") == "ok"
    assert Path(str(target)).read_text(encoding="utf-8") == "ok"



def test_wine_detection_is_consistent() -> None:
    from tests.windows._helpers import UNDER_WINE
    # The Windows job sets SHARDWISE_EXPECT_WINDOWS and runs under Wine; elsewhere it is False.
    if os.environ.get("SHARDWISE_EXPECT_WINDOWS") == "1":
        assert UNDER_WINE
    if not ON_WINDOWS:
        assert not UNDER_WINE
