"""Where ``shardwise convert`` writes: a fresh staging folder, swapped in when complete.

An export never mixes with an earlier one. The shards, index and ``config.json`` are written
into ``<out>.tmp-<pid>-<n>``, a new sibling folder of ``<out>``; only when every file is
complete does the staging folder take ``<out>``'s place:

* ``<out>`` does not exist: one ``os.replace`` of the folder (atomic).
* ``<out>`` exists: it must hold no earlier export (model weights, index, ``config.json``)
  unless ``overwrite`` is given. Files that are not part of an export (tokenizer files, a
  README, ``generation_config.json`` ...) are moved over into the staging folder, then the old
  folder is renamed aside, the staging folder renamed to ``<out>`` and the old one deleted.
  Readers see the old export or the new one; if the process is killed between the two
  renames, ``<out>`` is briefly missing and both exports are still on disk under the
  ``.tmp-`` names.
* ``<out>`` cannot be renamed (the current directory, a mount point): the old export files
  are deleted first, then the new ones moved in one by one (each move atomic).

A failed or interrupted export deletes its staging folder and leaves ``<out>`` untouched.
"""
from __future__ import annotations

import fnmatch
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

from ..errors import CheckpointError
from ..utils.logging import logger
from .atomic import TMP_MARKER, fsync_dir, temp_name_for

#: File names that belong to a model export: weights in any Hugging Face layout, their
#: index and the model config. Everything else in the output folder is the user's and kept.
EXPORT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "pytorch_model.bin",
                   "pytorch_model-*-of-*.bin", "*.safetensors.index.json", "*.bin.index.json",
                   "config.json")


def is_export_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in EXPORT_PATTERNS)


def export_files(folder: Path) -> List[str]:
    """Names of the export files directly in ``folder`` (sorted; empty if it does not exist)."""
    if not folder.is_dir():
        return []
    return sorted(e.name for e in folder.iterdir() if e.is_file() and is_export_file(e.name))


def check_output_folder(target: Path, overwrite: bool) -> None:
    """Refuse a file as the target, or a folder holding an earlier export without ``overwrite``."""
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"output {str(target)!r} is a file, not a folder; give a folder "
                              "path for the exported model")
    previous = export_files(target)
    if previous and not overwrite:
        shown = ", ".join(previous[:4]) + (f" and {len(previous) - 4} more" if len(previous) > 4
                                           else "")
        raise CheckpointError(
            f"output folder {str(target)!r} already holds an export ({shown}); writing into it "
            "would mix two models. Pass --overwrite (export_safetensors(..., overwrite=True)) to "
            "replace that export, or choose an empty/new folder.")


def _carry_user_files(old: Path, stage: Path) -> List[str]:
    """Move the non-export entries of ``old`` into ``stage``; a config.json only when the new
    export wrote none (it is then the user's own). Returns the names moved."""
    moved = []
    for entry in sorted(old.iterdir()):
        if TMP_MARKER in entry.name or (stage / entry.name).exists():
            continue
        if entry.is_file() and is_export_file(entry.name) and entry.name != "config.json":
            continue
        os.replace(entry, stage / entry.name)
        moved.append(entry.name)
    return moved


def _replace_in_place(stage: Path, target: Path) -> None:
    """Fallback when ``target`` itself cannot be renamed: old export out, new files in."""
    new_names = {e.name for e in stage.iterdir()}
    for name in export_files(target):
        if name != "config.json" or "config.json" in new_names:
            (target / name).unlink()
    for entry in stage.iterdir():
        os.replace(entry, target / entry.name)
    stage.rmdir()
    fsync_dir(target)


def swap_in(stage: Path, target: Path) -> None:
    """Make the complete export in ``stage`` the content of ``target`` (see the module doc)."""
    if not target.exists():
        os.replace(stage, target)
        fsync_dir(target.parent)
        return
    cwd = Path.cwd().resolve()
    if target.resolve() == cwd or target.resolve() in cwd.parents:  # renaming it strands the cwd
        _replace_in_place(stage, target)
        return
    kept = _carry_user_files(target, stage)
    backup = temp_name_for(target)
    try:
        os.replace(target, backup)
    except OSError:  # a mount point, or a folder Windows holds open
        for name in kept:
            os.replace(stage / name, target / name)
        _replace_in_place(stage, target)
        return
    os.replace(stage, target)
    fsync_dir(target.parent)
    shutil.rmtree(backup, ignore_errors=True)
    if kept:
        logger.info(f"kept {len(kept)} file(s) that are not part of the export: {', '.join(kept)}")


@contextmanager
def staged_export(output_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh staging folder; on success swap it in as ``output_dir``, on error delete it."""
    target = Path(os.path.abspath(output_dir))
    check_output_folder(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = temp_name_for(target)
    stage.mkdir()
    try:
        yield stage
        swap_in(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
